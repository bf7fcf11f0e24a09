"""DeepInfer's PROMPT and COMPLETION engines for prefill/decode disaggregation, on its hooks.

One subclass of DeepInfer's `LLMEngine` (as the prefix cache's is) for either role:
`init_pd_split` (called by DeepInfer for every engine that is not NORMAL, once its cache engine
exists) starts the role, and the role's work runs where DeepInfer leaves room for it. PROMPT
(`prompt_role`): prompts are placed in blocks the role knows before `step()`, and
`send_processed_prompts` holds each prefilled one for a decode server. COMPLETION
(`completion_role`): requests wait for their KV off DeepInfer's queue and enter through
`fork_seq` before `step()`. Each role is the rank's connector
(`disaggregation.transfer.connector`), which the engine driver reads through
`abilities.DeepInferAbilities`.

Both report work DeepInfer's scheduler does not know of through `so_builder_has_pending`, the
one local term `has_unfinished_requests` adds before its DP all-reduce: a rank whose only work
is a pull or a prompt still to place keeps the group stepping.
"""

from __future__ import annotations

from typing import Any

from deepinfer_server.disaggregation.role import DisaggregationRole
from deepinfer_server.engines.deepinfer.add_request import add_request_args
from deepinfer_server.engines.deepinfer.completion_role import CompletionRole
from deepinfer_server.engines.deepinfer.prompt_role import PromptRole
from deepinfer_server.engines.role_settings import RoleSettings


def role_engine(base: type[Any], role: DisaggregationRole, settings: RoleSettings) -> type[Any]:
    """A subclass of DeepInfer's `LLMEngine` class `base` playing `role`: PREFILL prefills
    for decode servers (construct it with `engine_type=EngineType.PROMPT`), DECODE continues
    prompts prefill servers computed (`engine_type=EngineType.COMPLETION` and
    `stop_preempted_request=True`)."""
    assert role.disaggregated, "a NORMAL engine plays no role"
    role_class = PromptRole if role is DisaggregationRole.PREFILL else CompletionRole

    class RoleLLMEngine(base):  # type: ignore[misc]
        """DeepInfer's PROMPT or COMPLETION engine, its KV handed to or pulled from a peer."""

        role: PromptRole | CompletionRole

        def init_pd_split(self) -> None:
            self.role = role_class(self, settings)

        def add_request(self, *args: Any, **kwargs: Any) -> Any:
            return self.role.add(super().add_request, add_request_args(*args, **kwargs))

        def abort_request(self, request_id: Any) -> tuple[int, int]:
            ids = [request_id] if isinstance(request_id, str) else list(request_id)
            return self.role.abort_request(super().abort_request, ids)

        def so_builder_has_pending(self) -> bool:
            return bool(super().so_builder_has_pending()) or self.role.busy

        def step(self) -> Any:
            self.role.before_step()
            return super().step()

        def flush_inflight_reqs(self) -> Any:
            self.role.before_flush()
            return super().flush_inflight_reqs()

        def send_processed_prompts(self) -> None:
            self.role.send_processed_prompts()

        def close(self) -> None:
            role = getattr(self, "role", None)  # None: the constructor failed before it
            if role is not None and not self.closed:
                role.close()
            super().close()

    return RoleLLMEngine
