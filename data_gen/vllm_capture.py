"""Hidden-state capture with real vLLM: the harvester backend that batches like a server.

vLLM's own extraction does the work: the ``extract_hidden_states`` speculative method
makes the target return the residual stream at the configured layers, a cache-only
"draft" stores it in a KV-cache group of its own, and a KV connector copies each finished
request's rows out of that cache into a per-request safetensors file. Per token this
returns exactly what :meth:`eagle3.target.model.Target.forward` returns:

* ``aux``: the **inputs** of the aux decoder layers, ascending. vLLM's layer id ``i`` is
  ``hidden_states + residual`` after ``i`` decoder layers, i.e. HF's
  ``output_hidden_states[i]`` (id 0 is the embedding output);
* ``last``: the **pre-norm** output of the last decoder layer. It is vLLM's layer id
  ``N`` (the number of decoder layers), which we append to the aux ids; vLLM captures it
  before the final norm.

Upstream's ``ExampleHiddenStatesConnector`` copies through CUDA streams into pinned host
memory and so fails on CPU; :class:`SyncHiddenStatesConnector` below reuses its scheduler
side and writes synchronously instead (to ``<name>.partial``, then renamed, so a file
that exists is complete). vLLM loads it by module path, from the engine process.

Prefix caching and chunked prefill must be off: with prefix caching a request's cached
prefix is never recomputed, so its rows are never written (vLLM #44485); with chunked
prefill a prompt spans several steps. Both are forced off here, and every request's row
count and token ids are checked against its input.

vLLM pins its own torch and transformers, so this runs from the separate venv made by
``scripts/setup_vllm_env.sh``; importing this module does not import vLLM.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from eagle3.errors import Eagle3Error
from eagle3.target.model import check_aux_layer_ids

CONNECTOR_NAME = "SyncHiddenStatesConnector"
"""Class name vLLM's connector factory looks up in this module (``kv_connector_module_path``)."""

_FORCED_OFF = ("enable_prefix_caching", "enable_chunked_prefill")


class VllmCaptureError(Eagle3Error, RuntimeError):
    """vLLM returned hidden states that do not match the request; the message says how."""


class VllmCapture:
    """A vLLM engine over a local model folder that returns aux and pre-norm last states."""

    name = "vllm"

    def __init__(self, model: str, aux_layer_ids: Sequence[int], *, dtype: str = "float32",
                 max_model_len: int = 4096, file_timeout_s: float = 120.0, **engine_args: Any) -> None:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB; vLLM's CPU backend needs a budget
        from transformers import AutoConfig
        from vllm import LLM

        from data_gen.nvfp4 import prepare_vllm_on_cpu

        prepare_vllm_on_cpu(model)

        for key in _FORCED_OFF:
            if engine_args.pop(key, False):
                raise ValueError(f"{key}=True breaks hidden-state capture (short or partial rows); leave it off")
        self.num_layers = int(AutoConfig.from_pretrained(model).get_text_config().num_hidden_layers)
        self.aux_layer_ids = check_aux_layer_ids(aux_layer_ids, self.num_layers)
        captured_ids = [*self.aux_layer_ids, self.num_layers]  # N: pre-norm output of the last layer
        self.max_model_len = max_model_len
        self.file_timeout_s = file_timeout_s
        self._dir = tempfile.mkdtemp(prefix="eagle3-vllm-capture-")
        self._cleanup = weakref.finalize(self, shutil.rmtree, self._dir, True)

        settings: dict[str, Any] = dict(
            model=model, tokenizer=model, dtype=dtype, max_model_len=max_model_len,
            enable_prefix_caching=False, enable_chunked_prefill=False,
            # every prompt in one step: chunked prefill is off, so the step budget must hold the longest
            max_num_batched_tokens=max(max_model_len, engine_args.pop("max_num_batched_tokens", 0)),
            speculative_config={
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": captured_ids}},
            },
            kv_transfer_config={
                "kv_connector": CONNECTOR_NAME,
                "kv_connector_module_path": __name__,
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": self._dir},
            },
        )
        if not torch.cuda.is_available():
            settings["enforce_eager"] = True
        settings.update(engine_args)
        try:
            self.llm = LLM(**settings)
        except BaseException:
            self.close()
            raise
        config = self.llm.llm_engine.vllm_config
        if config.cache_config.enable_prefix_caching or config.scheduler_config.enable_chunked_prefill:
            self.close()
            raise VllmCaptureError("vLLM turned prefix caching or chunked prefill back on; capture would be wrong")
        from vllm.v1.engine.core_client import InprocClient

        # With VLLM_ENABLE_V1_MULTIPROCESSING=0 the engine steps only when asked; the files are
        # written one step after the requests finish, so capture() then steps it itself.
        self._in_process = isinstance(getattr(self.llm.llm_engine, "engine_core", None), InprocClient)

    def close(self) -> None:
        """Shut the engine down and remove the temporary directory (removed at collection too)."""
        engine = getattr(getattr(self, "llm", None), "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        if core is not None:
            core.shutdown()
        self._cleanup()

    def __enter__(self) -> VllmCapture:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def capture(self, sequences: Sequence[Sequence[int]]) -> list[tuple[Tensor, Tensor]]:
        """Per sequence of token ids: (aux [T, n_aux, H] = inputs of the aux layers, ascending ids;
        last [T, H] = pre-norm output of the last decoder layer), float32 on CPU, T == len(sequence)."""
        from vllm import SamplingParams

        seqs = [[int(t) for t in s] for s in sequences]
        for row, seq in enumerate(seqs):
            if not seq:
                raise ValueError(f"sequence {row} is empty")
            if len(seq) >= self.max_model_len:  # vLLM needs room for the one token it samples
                raise ValueError(f"sequence {row} has {len(seq)} tokens; max_model_len is {self.max_model_len}")
        if not seqs:
            return []
        # One sampled token per request: the prompt's rows are all that is kept.
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        outs = self.llm.generate([{"prompt_token_ids": s} for s in seqs], params, use_tqdm=False)
        paths = [(out.kv_transfer_params or {}).get("hidden_states_path") for out in outs]
        try:
            return [self._read(row, seq, path) for row, (seq, path) in enumerate(zip(seqs, paths, strict=True))]
        finally:
            for path in paths:
                if path:
                    _remove(path)

    def _read(self, row: int, seq: list[int], path: str | None) -> tuple[Tensor, Tensor]:
        from safetensors.torch import load_file

        if not path or os.path.dirname(os.path.abspath(path)) != os.path.abspath(self._dir):
            raise VllmCaptureError(f"request {row}: vLLM returned no hidden-states file in {self._dir} ({path!r})")
        deadline = time.monotonic() + self.file_timeout_s
        while not os.path.exists(path):  # written by the engine a step after the request finishes
            if time.monotonic() > deadline:
                raise VllmCaptureError(f"request {row}: {path} not written within {self.file_timeout_s:.0f} s")
            if self._in_process:
                self.llm.llm_engine.step()
            else:
                time.sleep(0.002)
        data = load_file(path, device="cpu")
        states = data["hidden_states"]  # [T, n_aux + 1, hidden]
        tokens = data["token_ids"].tolist()
        n_aux = len(self.aux_layer_ids)
        if states.shape[0] != len(seq) or tokens != seq:
            raise VllmCaptureError(
                f"request {row}: {states.shape[0]} rows for {len(seq)} input tokens "
                f"(token ids {'equal' if tokens == seq else 'differ'}); prefix caching or chunked prefill on?"
            )
        if states.dim() != 3 or states.shape[1] != n_aux + 1:
            raise VllmCaptureError(f"request {row}: hidden states of shape {tuple(states.shape)}, "
                                   f"expected [{len(seq)}, {n_aux + 1}, hidden]")
        states = states.float()
        return states[:, :n_aux].contiguous(), states[:, n_aux].contiguous()


def _remove(path: str) -> None:
    for name in (path, path + ".partial"):
        try:
            os.remove(name)
        except FileNotFoundError:
            pass


@functools.cache
def _connector_class() -> type:
    """Built on first use, so that importing this module does not import vLLM."""
    from safetensors.torch import save_file
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        ExampleHiddenStatesConnector,
        ExampleHiddenStatesConnectorMetadata,
        PendingSave,
        extract_from_kv_cache,
    )

    class SyncHiddenStatesConnector(ExampleHiddenStatesConnector):
        """vLLM's example hidden-states connector with a synchronous, device-agnostic write.

        Scheduler side unchanged (one file per request, blocks held until written). Worker
        side: when a finished request's save arrives, its rows are gathered from the
        hidden-states cache, copied to CPU and written to ``<file>.partial``, then renamed;
        the request is reported done at once. No streams, events, pinned memory or locks.
        """

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
            super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
            self._executor.shutdown(wait=False)  # upstream's async writer pool: unused here
            self.use_lock = False
            self._written: set[str] = set()

        def wait_for_save(self) -> None:
            pass  # upstream pre-creates lock files here; a renamed file needs none

        def _submit_async_write(self, pending: PendingSave) -> None:
            if not self._is_tp_rank_zero:
                return
            assert self._kv_cache is not None
            blocks = torch.tensor(pending.block_ids, dtype=torch.long)
            offsets = torch.arange(self._block_size, dtype=torch.long)
            slots = (blocks[:, None] * self._block_size + offsets[None, :]).flatten()  # [n_blocks * block]
            num_tokens = pending.token_ids.shape[0]
            states = extract_from_kv_cache(self._kv_cache, slots.to(self._kv_cache.device), num_tokens)
            tensors = {"hidden_states": states.to("cpu", copy=True).contiguous(),  # [T, n_states, hidden]
                       "token_ids": pending.token_ids.clone()}
            os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
            partial = pending.filename + ".partial"
            save_file(tensors, partial)
            os.replace(partial, pending.filename)
            self._written.add(pending.req_id)

        def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
            if self.has_connector_metadata():
                meta = self._get_connector_metadata()
                if isinstance(meta, ExampleHiddenStatesConnectorMetadata):
                    for pending in meta.pending_saves:
                        self._submit_async_write(pending)
            done, self._written = self._written, set()
            return done or None, None

    SyncHiddenStatesConnector.__module__ = __name__
    SyncHiddenStatesConnector.__qualname__ = CONNECTOR_NAME
    return SyncHiddenStatesConnector


def __getattr__(name: str) -> Any:
    if name == CONNECTOR_NAME:
        return _connector_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CONNECTOR_NAME", "VllmCapture", "VllmCaptureError"]
