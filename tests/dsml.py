"""DeepSeek V4.1 DSML tool-call markup, as the model writes it (and the simulated engine echoes)."""

from __future__ import annotations


def invoke(name: str, **string_params: str) -> str:
    params = "".join(
        f'<｜DSML｜ parameter name="{key}" string="true">{value}</｜DSML｜ parameter>\n'
        for key, value in string_params.items()
    )
    return f'<｜DSML｜ invoke name="{name}">\n{params}</｜DSML｜ invoke>\n'


def tool_calls_block(name: str, **string_params: str) -> str:
    return f"<｜DSML｜ calls>\n{invoke(name, **string_params)}</｜DSML｜ calls>"


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
