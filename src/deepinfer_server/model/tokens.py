"""DeepSeek-V4.1's special tokens the server names (the one place each is spelled)."""

from __future__ import annotations

#: The token that begins every prompt.
BOS_TOKEN = "<｜begin▁of▁sentence｜>"
#: The token that ends every assistant turn (the engine's stop token).
EOS_TOKEN = "<｜end▁of▁sentence｜>"
#: The V4.1 encoding's system-turn token, absent from DeepSeek-V4's tokenizer.
SYSTEM_TOKEN = "<｜System｜>"
#: The last reserved slot before the named special tokens: `<｜place▁holder▁no▁799｜>` in V4.
SYSTEM_TOKEN_ID = 128799
