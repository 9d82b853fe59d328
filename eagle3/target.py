"""The target model: load it, run it with a KV cache, and capture what EAGLE-3 feeds on.

One capture implementation for the whole project: the harvester, the serving loop and
mining all read hidden states through :meth:`Target.forward`.

Per token it returns

* ``aux``: the **inputs** of the configured decoder layers (default ``2, N//2, N-3``),
  ascending, i.e. HF's ``output_hidden_states[i]`` for those ``i``;
* ``last``: the **pre-norm** output of the last decoder layer (what vLLM captures as layer
  ``N``; HF's ``hidden_states[N]`` is after the final norm on Llama), so that
  ``head(last)`` gives the target's logits.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from eagle3.nvfp4 import load_emulated, nvfp4_quantization
from eagle3.target_source import TargetSourceError, resolve_target

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TargetLoadError(RuntimeError):
    """A target folder could not be loaded as a supported causal LM; the message names it."""


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's layers: the inputs of layers 2, N//2 and N-3."""
    return check_aux_layer_ids((2, num_layers // 2, num_layers - 3), num_layers)


def check_aux_layer_ids(ids: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """Validate layer ids against the target depth; returns them ascending (as vLLM orders them)."""
    ids = tuple(int(i) for i in ids)
    if not ids:
        raise ValueError("aux_layer_ids is empty")
    if len(set(ids)) != len(ids):
        raise ValueError(
            f"aux_layer_ids {list(ids)} has duplicates (target has {num_layers} layers); "
            "pass distinct ids explicitly"
        )
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"aux_layer_ids {bad} out of range for a target with {num_layers} decoder layers")
    return tuple(sorted(ids))


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


@dataclass
class TargetOutput:
    aux: Tensor  # [batch, seq, n_aux, hidden] inputs of the aux layers, ascending ids
    last: Tensor  # [batch, seq, hidden] pre-norm output of the last decoder layer
    logits: Tensor | None  # [batch, seq, vocab] or None when not requested
    past_key_values: Any  # transformers Cache, or None without use_cache


class Target:
    """A frozen causal LM with aux-layer capture. Runs under ``torch.no_grad``."""

    def __init__(self, model: nn.Module, tokenizer: Any, aux_layer_ids: Sequence[int] | None = None,
                 name: str = "") -> None:
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.name = name
        decoder = _find_decoder(model)
        self.layers: nn.ModuleList = decoder.layers
        self.norm: nn.Module = decoder.norm
        self.embed_tokens: nn.Module = decoder.embed_tokens
        self.lm_head: nn.Module = model.get_output_embeddings()
        self.num_layers = len(self.layers)
        self.aux_layer_ids = (
            default_aux_layer_ids(self.num_layers) if aux_layer_ids is None
            else check_aux_layer_ids(aux_layer_ids, self.num_layers)
        )
        self._captured: dict[int | str, Tensor] | None = None
        for i in self.aux_layer_ids:
            self.layers[i].register_forward_pre_hook(functools.partial(self._keep_input, i), with_kwargs=True)
        self.norm.register_forward_pre_hook(functools.partial(self._keep_input, "last"), with_kwargs=True)

    def _keep_input(self, key: int | str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._captured is not None:
            self._captured[key] = args[0] if args else kwargs["hidden_states"]

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def hidden_size(self) -> int:
        return self.embed_tokens.weight.shape[1]

    @property
    def vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @torch.no_grad()
    def head(self, last: Tensor) -> Tensor:
        """Logits from pre-norm last-layer states: the target's final norm, then lm_head."""
        return self.lm_head(self.norm(last))

    @torch.no_grad()
    def forward(
        self,
        input_ids: Tensor,  # [batch, seq]
        attention_mask: Tensor | None = None,  # [batch, past + seq], 0 at padding
        past_key_values: Any = None,
        *,
        use_cache: bool = False,
        return_logits: bool = True,
        position_ids: Tensor | None = None,  # [batch, seq]
    ) -> TargetOutput:
        """Run the target on new tokens, continuing ``past_key_values`` if given.

        With padding (left or right), pass ``attention_mask`` covering past and new tokens:
        position ids are then counted over real tokens only, so a padded row computes
        exactly what it would alone. For tree verification pass a 4D bool ``attention_mask``
        [batch, 1, seq, past + seq] (True: may attend) with explicit ``position_ids``.
        """
        batch, seq = input_ids.shape
        past_len = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is not None:
            if attention_mask is not None and attention_mask.dim() != 4:
                raise ValueError("explicit position_ids go with a 4D attention_mask (or none)")
        elif attention_mask is not None:
            if attention_mask.shape != (batch, past_len + seq):
                raise ValueError(
                    f"attention_mask has shape {tuple(attention_mask.shape)}, "
                    f"expected {(batch, past_len + seq)} (past {past_len} + new {seq})"
                )
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, past_len:]
        else:
            position_ids = torch.arange(past_len, past_len + seq, device=input_ids.device).expand(batch, seq)
        self._captured = {}
        try:
            out = self.model.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=past_key_values,
                use_cache=use_cache,
            )
            captured = self._captured
        finally:
            self._captured = None
        aux = torch.stack([captured[i] for i in self.aux_layer_ids], dim=2)  # [batch, seq, n_aux, hidden]
        logits = self.lm_head(out.last_hidden_state) if return_logits else None
        return TargetOutput(aux=aux, last=captured["last"], logits=logits,
                            past_key_values=out.past_key_values if use_cache else None)

    __call__ = forward


def load_target(
    name_or_path: str,
    *,
    dtype: str = "auto",
    device: str = "auto",
    aux_layer_ids: Sequence[int] | None = None,
    attn_implementation: str = "sdpa",
    trust_remote_code: bool = False,
    home: Path | None = None,
    architecture: dict[str, Any] | None = None,
    nvfp4_mode: str = "auto",
) -> Target:
    """Load a target from an embedded name, a model folder, a ``.gguf`` file or a hub id.

    ``architecture``: config values the caller expects (a recipe's ``target.architecture``);
    a mismatch fails naming the key. An NVFP4 checkpoint (compressed-tensors
    ``nvfp4-pack-quantized``) runs emulated (:mod:`eagle3.nvfp4`): ``nvfp4_mode`` ``auto`` as its
    checkpoint says (W4A4 with activation scales), or ``w4a16`` for weight-only."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    resolved = resolve_target(name_or_path, home)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    where = resolved.location
    if resolved.kind == "folder" and not any(Path(where).glob("*.safetensors")):
        pickled = sorted(p.name for p in Path(where).glob("*.bin")) + sorted(p.name for p in Path(where).glob("*.pt"))
        detail = f"only pickled weights ({', '.join(pickled)})" if pickled else "no weights"
        raise TargetLoadError(
            f"{where}: {detail}; targets load from safetensors only (pickles are never unpickled): "
            "save the model with save_pretrained(..., safe_serialization=True) first"
        )
    try:
        if resolved.kind == "folder" and nvfp4_quantization(where) is not None:
            model = load_emulated(where, dtype=torch_dtype, mode=nvfp4_mode, attn_implementation=attn_implementation)
        else:
            model = AutoModelForCausalLM.from_pretrained(
                where, dtype=torch_dtype, use_safetensors=True, attn_implementation=attn_implementation,
                trust_remote_code=trust_remote_code,
            )
    except (OSError, ValueError, KeyError, TypeError, ImportError) as err:
        raise TargetLoadError(f"{where}: cannot load as a causal LM ({type(err).__name__}: {err})") from err
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise TargetLoadError(f"{where}: cannot load the tokenizer ({type(err).__name__}: {err})") from err
    if architecture:
        check_architecture(model.config, architecture, str(where))
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        tokenizer.pad_token = tokenizer.eos_token
    model.to(torch_device)
    try:
        return Target(model, tokenizer, aux_layer_ids, name=resolved.spec)
    except ValueError as err:
        raise TargetLoadError(f"{where}: {err}") from err


def check_architecture(config: Any, expected: dict[str, Any], where: str, prefix: str = "") -> None:
    """Every value of ``expected`` (nested dicts for sub-configs such as ``text_config``) equals the
    loaded config's; otherwise a :class:`TargetLoadError` naming the key."""
    for key, want in expected.items():
        got = config.get(key) if isinstance(config, dict) else getattr(config, key, None)
        if isinstance(want, dict) and got is not None:  # a sub-config or dict: the keys given must match
            check_architecture(got, want, where, f"{prefix}{key}.")
        elif got != want:
            raise TargetLoadError(f"{where}: target.architecture.{prefix}{key}={want!r}, but the model's config "
                                  f"has {got!r} (is the recipe for another model?)")


def _find_decoder(model: nn.Module) -> nn.Module:
    """The decoder stack of a causal LM: needs ``layers``, ``norm`` and ``embed_tokens``."""
    decoder = getattr(model, "model", None)
    arch = type(model).__name__
    if decoder is None or not all(hasattr(decoder, a) for a in ("layers", "norm", "embed_tokens")):
        raise ValueError(
            f"unsupported architecture {arch}: expected a decoder at .model with "
            ".layers, .norm and .embed_tokens (Llama, Qwen, Mistral, DeepSeek style)"
        )
    if model.get_output_embeddings() is None:
        raise ValueError(f"unsupported architecture {arch}: no output embeddings (lm_head)")
    return decoder


@torch.no_grad()
def check_capture(target: Target, input_ids: Tensor) -> dict[str, float]:
    """Max relative error of the capture against HF's ``output_hidden_states`` on one input.

    A diagnostic for targets of a new architecture: every value should be ~0. A large
    ``last_post_norm`` means the model's last hidden state is not ``norm(pre-norm state)``.
    """
    out = target(input_ids)
    ref = target.model(input_ids, output_hidden_states=True)

    def rel(a: Tensor, b: Tensor) -> float:
        return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-12)).item()

    errors = {f"layer_{i}_input": rel(out.aux[:, :, k], ref.hidden_states[i])
              for k, i in enumerate(target.aux_layer_ids)}
    errors["last_post_norm"] = rel(target.norm(out.last), ref.hidden_states[-1])
    errors["logits"] = rel(out.logits, ref.logits)
    return errors


__all__ = [
    "Target", "TargetLoadError", "TargetOutput", "TargetSourceError", "check_architecture", "check_aux_layer_ids",
    "check_capture",
    "default_aux_layer_ids", "load_target", "resolve_device", "resolve_dtype",
]
