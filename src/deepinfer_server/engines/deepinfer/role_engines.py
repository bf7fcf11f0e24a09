"""DeepInfer's PROMPT and COMPLETION engines for prefill/decode disaggregation, on its hooks.

Subclasses of DeepInfer's `LLMEngine` (as the prefix cache's is): `init_pd_split` (called by
DeepInfer for every engine that is not NORMAL, once its cache engine exists) starts the role,
and the role's work runs where DeepInfer leaves room for it. PROMPT (`prompt_role`): prompts
are placed in blocks the role knows before `step()`, and `send_processed_prompts` holds each
prefilled one for a decode server. COMPLETION (`completion_role`): requests wait for their KV
off DeepInfer's queue and enter through `fork_seq` before `step()`.

Both report work DeepInfer's scheduler does not know of through `so_builder_has_pending`, the
one local term `has_unfinished_requests` adds before its DP all-reduce: a rank whose only work
is a pull or a prompt still to place keeps the group stepping.
"""

from __future__ import annotations

from typing import Any

from deepinfer_server.disaggregation.handoff.params import KVTransferParams
from deepinfer_server.disaggregation.transfer.stats import TransferStats
from deepinfer_server.engines.deepinfer.completion_role import CompletionRole
from deepinfer_server.engines.deepinfer.prompt_role import PromptRole
from deepinfer_server.engines.deepinfer.role_settings import RoleSettings


def prompt_engine(base: type[Any], settings: RoleSettings) -> type[Any]:
    """A subclass of DeepInfer's `LLMEngine` class `base` that prefills for decode servers
    (construct it with `engine_type=EngineType.PROMPT`)."""

    class PromptLLMEngine(base):  # type: ignore[misc]
        """DeepInfer's PROMPT engine, holding each prefilled prompt's KV for a decode server."""

        role: PromptRole

        def init_pd_split(self) -> None:
            self.role = PromptRole(self, settings)

        def add_request(
            self,
            user_id: str,
            request_id: str,
            sampling_params: Any,
            prompt_token_ids: Any,
            multi_modal_data: Any = None,
            arrival_time: float | None = None,
            extra: Any = None,
            enqueue: bool = True,
            chunk_checkpoints: Any = None,
        ) -> Any:
            args = (user_id, request_id, sampling_params, prompt_token_ids, multi_modal_data)
            rest = (arrival_time, extra, enqueue, chunk_checkpoints)
            return self.role.add(super().add_request, (*args, *rest))

        def abort_request(self, request_id: Any) -> tuple[int, int]:
            ids = [request_id] if isinstance(request_id, str) else list(request_id)
            queued = self.role.abort(set(ids))
            found, tokens = super().abort_request(ids)
            self.role.free_aborted(set(ids))
            return found + queued, tokens

        def so_builder_has_pending(self) -> bool:
            return bool(super().so_builder_has_pending()) or self.role.busy

        def step(self) -> Any:
            self.role.collect()
            self.role.place()
            return super().step()

        def flush_inflight_reqs(self) -> Any:
            self.role.collect()
            return super().flush_inflight_reqs()

        def send_processed_prompts(self) -> None:
            self.role.send_processed_prompts()

        def pop_kv_handoff(self, request_id: str) -> KVTransferParams | None:
            """The handoff of a request that ended after its prompt step, if any."""
            return self.role.handoffs.pop(request_id, None)

        def held_kv(self) -> int:
            """Prompts held for decode servers now."""
            return len(self.role.held)

        def close(self) -> None:
            role = getattr(self, "role", None)  # None: the constructor failed before it
            if role is not None and not self.closed:
                role.close()
            super().close()

    return PromptLLMEngine


def completion_engine(base: type[Any], settings: RoleSettings) -> type[Any]:
    """A subclass of DeepInfer's `LLMEngine` class `base` that continues prompts prefill
    servers computed (construct it with `engine_type=EngineType.COMPLETION` and
    `stop_preempted_request=True`)."""

    class CompletionLLMEngine(base):  # type: ignore[misc]
        """DeepInfer's COMPLETION engine, pulling each request's KV before it decodes."""

        role: CompletionRole

        def init_pd_split(self) -> None:
            self.role = CompletionRole(self, settings)

        def add_request(
            self,
            user_id: str,
            request_id: str,
            sampling_params: Any,
            prompt_token_ids: Any,
            multi_modal_data: Any = None,
            arrival_time: float | None = None,
            extra: Any = None,
            enqueue: bool = True,
            chunk_checkpoints: Any = None,
        ) -> Any:
            args = (user_id, request_id, sampling_params, prompt_token_ids, multi_modal_data)
            rest = (arrival_time, extra, enqueue, chunk_checkpoints)
            return self.role.add(super().add_request, (*args, *rest))

        def abort_request(self, request_id: Any) -> tuple[int, int]:
            ids = [request_id] if isinstance(request_id, str) else list(request_id)
            waiting = self.role.abort(set(ids))
            rest = [rid for rid in ids if rid not in waiting]
            found, tokens = super().abort_request(rest) if rest else (0, 0)
            return found + len(waiting), tokens

        def so_builder_has_pending(self) -> bool:
            return bool(super().so_builder_has_pending()) or self.role.busy

        def step(self) -> Any:
            self.role.advance()
            return super().step()

        def take_ended_requests(self) -> list[tuple[str, str]]:
            """(request ID, finish string) of requests whose KV never arrived."""
            ended, self.role.ended = self.role.ended, []
            return ended

        @property
        def prompt_tokens_computed(self) -> int:
            return self.role.prompt_tokens_computed

        def kv_transfer_stats(self) -> TransferStats:
            """The pulls' counters."""
            return self.role.stats

        def close(self) -> None:
            role = getattr(self, "role", None)  # None: the constructor failed before it
            if role is not None and not self.closed:
                role.close()
            super().close()

    return CompletionLLMEngine
