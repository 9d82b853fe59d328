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
import inspect
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor, nn

from eagle3.device import resolve_device, resolve_dtype, sdpa_backends
from eagle3.errors import ConfigError, Eagle3Error
from eagle3.target.nvfp4 import load_emulated, nvfp4_quantization
from eagle3.target.positions import ROPE_KEYS, rope_difference
from eagle3.target.source import TargetSourceError, resolve_target


class TargetLoadError(Eagle3Error, RuntimeError):
    """A target folder could not be loaded as a supported causal LM; the message names it."""


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's layers: the inputs of layers 2, N//2 and N-3."""
    return check_aux_layer_ids((2, num_layers // 2, num_layers - 3), num_layers)


def check_aux_layer_ids(ids: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """Validate layer ids against the target depth; returns them ascending (as vLLM orders them)."""
    ids = tuple(int(i) for i in ids)
    if not ids:
        raise ConfigError("aux_layer_ids is empty")
    if len(set(ids)) != len(ids):
        raise ConfigError(
            f"aux_layer_ids {list(ids)} has duplicates (target has {num_layers} layers); "
            "pass distinct ids explicitly"
        )
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise ConfigError(f"aux_layer_ids {bad} out of range for a target with {num_layers} decoder layers")
    return tuple(sorted(ids))


_UNHANDLED_LOGIT_KEYS = ("logits_mup_width_multiplier", "unpadded_vocab_size")
"""Config keys of families whose logits are more than a scale and a cap of lm_head's output
(Inkling's width multiplier on the hidden state and sliced vocabulary)."""


@dataclass(frozen=True)
class LogitTransform:
    """What a causal LM does to ``lm_head``'s output before returning its logits:
    ``softcap * tanh(scale * z / softcap)``, or ``scale * z`` without a cap (Llama, Qwen,
    DeepSeek: the identity). Increasing, so it never changes the argmax; the distribution it does."""

    scale: float = 1.0
    softcap: float | None = None

    def __post_init__(self) -> None:
        if not self.scale > 0 or (self.softcap is not None and not self.softcap > 0):
            raise ValueError(f"logit scale {self.scale} / softcap {self.softcap}: both must be > 0")

    @classmethod
    def of(cls, config: Any) -> LogitTransform:
        """The transform of a HF config (its text config for multimodal ones). Families whose
        ``logits_scaling`` divides (Granite, MiniCPM3) or multiplies (HyperCLOVA X), Cohere's
        ``logit_scale`` and Gemma-style ``final_logit_softcapping``; :func:`load_target` checks the
        result against the model's own logits, so a family missing here fails at load."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        kind = str(getattr(text, "model_type", ""))
        unknown = [key for key in _UNHANDLED_LOGIT_KEYS if getattr(text, key, None) is not None]
        if unknown:
            raise ValueError(f"model_type {kind!r}: its logits depend on {', '.join(unknown)}, which the capture "
                             "does not reproduce; this architecture is not supported")
        scale = 1.0
        if kind.startswith("cohere") and getattr(config, "model_type", "") != "cohere2_vision":  # that one skips it
            scale = float(getattr(text, "logit_scale", None) or 1.0)
        elif kind.startswith("granite") or kind == "minicpm3":
            scale = 1.0 / float(text.logits_scaling)
        elif kind == "hyperclovax":
            scale = float(text.logits_scaling)
        elif kind.startswith("muse_"):
            scale = float(getattr(text, "output_multiplier", None) or 1.0)
        cap = getattr(text, "final_logit_softcapping", None)
        return cls(scale=scale, softcap=float(cap) if cap else None)

    @property
    def identity(self) -> bool:
        return self.scale == 1.0 and self.softcap is None

    def __call__(self, logits: Tensor) -> Tensor:
        logits = logits * self.scale if self.scale != 1.0 else logits
        return logits if self.softcap is None else torch.tanh(logits / self.softcap) * self.softcap


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
        self.location: str | None = None  # where the loaders found it: a folder, or a hub id
        self.decoder = decoder = _find_decoder(model)
        self.layers: nn.ModuleList = decoder.layers
        self.norm: nn.Module = decoder.norm
        self.embed_tokens: nn.Module = decoder.embed_tokens
        self.lm_head: nn.Module = model.get_output_embeddings()
        self.logit_transform = LogitTransform.of(model.config)
        self.num_layers = len(self.layers)
        self.aux_layer_ids = (
            default_aux_layer_ids(self.num_layers) if aux_layer_ids is None
            else check_aux_layer_ids(aux_layer_ids, self.num_layers)
        )
        self._captured: dict[int | str, Tensor] | None = None
        self.head_only = False
        """Set by :func:`load_target_head`: the decoder layers were never loaded."""
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
    def final_norm_scale(self) -> Tensor | None:
        """The weight [H] (fp32, CPU) a plain RMSNorm (``x / rms(x) * w``) needs to compute what the
        target's final norm computes: Llama's ``weight``, Gemma's ``1 + weight`` (its convention
        stores the offset). Read by probing the module, so any convention is covered; None where
        the norm is not a per-channel scaling of ``x / rms(x)`` (a LayerNorm that subtracts the mean)."""
        weight = getattr(self.norm, "weight", None)
        if not isinstance(weight, Tensor) or weight.dim() != 1 or weight.device.type == "meta":
            return None
        h, c = weight.shape[0], 1e3  # x = c * ones: x / rms(x) = 1 to within eps / (2 c^2)
        scale = self.norm(torch.full((1, h), c, dtype=weight.dtype, device=weight.device)).float()[0]
        probe = torch.randn(4, h, generator=torch.Generator(device="cpu").manual_seed(0)).to(weight.device)
        eps = float(getattr(self.norm, "variance_epsilon", getattr(self.norm, "eps", 1e-6)) or 0.0)
        want = probe / (probe.pow(2).mean(-1, keepdim=True) + eps).sqrt() * scale
        if not torch.allclose(self.norm(probe.to(weight.dtype)).float(), want, rtol=1e-2, atol=1e-3):
            return None
        scale = scale.cpu()
        exact = weight.detach().float().cpu()
        return exact if torch.allclose(scale, exact, rtol=1e-2, atol=1e-3) else scale  # the stored weight itself

    @torch.no_grad()
    def head(self, last: Tensor) -> Tensor:
        """Logits from pre-norm last-layer states: the target's final norm, lm_head and logit transform."""
        return self.logit_transform(self.lm_head(self.norm(last)))

    @torch.no_grad()
    def forward(
        self,
        input_ids: Tensor,  # [batch, seq]
        attention_mask: Tensor | dict[str, Tensor] | None = None,  # [batch, past + seq], 0 at padding
        past_key_values: Any = None,
        *,
        use_cache: bool = False,
        return_logits: bool = True,
        position_ids: Tensor | None = None,  # [batch, seq]
        cache_position: Tensor | None = None,  # [seq]: the cache slots of the new tokens (a static cache)
    ) -> TargetOutput:
        """Run the target on new tokens, continuing ``past_key_values`` if given.

        With padding (left or right), pass ``attention_mask`` covering past and new tokens:
        position ids are then counted over real tokens only, so a padded row computes
        exactly what it would alone. For tree verification pass a 4D bool ``attention_mask``
        [batch, 1, seq, past + seq] (True: may attend) with explicit ``position_ids``. A static
        cache (stale slots past the live length) takes ``cache_position``: the new tokens' slots, which
        are their positions unless ``position_ids`` and a 4D mask over every slot are given too.
        """
        if self.head_only:
            raise RuntimeError(f"target {self.name}: loaded with load_target_head (embedding, final norm and "
                               "lm_head only); use load_target to run it")
        batch, seq = input_ids.shape
        if cache_position is not None:  # the slots; the positions too unless given (a tree, with its 4D mask)
            assert (attention_mask is None) == (position_ids is None)
            position_ids = cache_position.expand(batch, seq) if position_ids is None else position_ids
        past_len = 0 if past_key_values is None or cache_position is not None else past_key_values.get_seq_length()
        if position_ids is not None:
            if attention_mask is not None and not isinstance(attention_mask, dict) and attention_mask.dim() != 4:
                raise ValueError("explicit position_ids go with a 4D attention_mask (or a dict per layer type)")
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
            with sdpa_backends(input_ids.device):
                out = self.decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   use_cache=use_cache, **{self._cache_kwarg: past_key_values},
                                   **({} if cache_position is None else {"cache_position": cache_position}))
            captured = self._captured
        finally:
            self._captured = None
        aux = torch.stack([captured[i] for i in self.aux_layer_ids], dim=2)  # [batch, seq, n_aux, hidden]
        logits = self.logit_transform(self.lm_head(out.last_hidden_state)) if return_logits else None
        return TargetOutput(aux=aux, last=captured["last"], logits=logits,
                            past_key_values=getattr(out, self._cache_kwarg) if use_cache else None)

    __call__ = forward

    @functools.cached_property
    def _cache_kwarg(self) -> str:  # transformers 5.24 renamed past_key_values (in and out) to cache
        return "cache" if "cache" in inspect.signature(self.decoder.forward).parameters else "past_key_values"


def from_pretrained_complete(model_class: Any, where: str | os.PathLike[str], **kwargs: Any) -> Any:
    """``model_class.from_pretrained`` that refuses a checkpoint missing weights of the text path
    (decoder, embedding, final norm, lm_head): transformers would start them at random and only log
    it, a target that silently is not the target. A multimodal checkpoint may lack its vision tower."""
    model, info = model_class.from_pretrained(where, output_loading_info=True, **kwargs)
    names = {id(m): n for n, m in model.named_modules()}
    try:
        parts = (_find_decoder(model), model.get_output_embeddings())
    except ValueError:  # not a supported decoder: every weight counts (Target then names the architecture)
        parts = (model,)
    text = [names[id(m)] for m in parts if m is not None and id(m) in names]
    missing = sorted(k for k in info.get("missing_keys") or ()
                     if any(not t or k == t or k.startswith(t + ".") for t in text))
    if missing:
        raise TargetLoadError(f"{where}: the checkpoint lacks {len(missing)} of the model's weights "
                              f"({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}); a truncated or "
                              "partial download?")
    return model


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
    ``nvfp4-pack-quantized``) runs emulated (:mod:`eagle3.target.nvfp4`): ``nvfp4_mode`` ``auto`` as its
    checkpoint says (W4A4 with activation scales), or ``w4a16`` for weight-only. A multimodal
    checkpoint loads whole; only its text path is run. The capture is checked against the model's
    own forward on a short probe (:func:`verify_capture`). ``attn_implementation="sdpa"`` (the
    default) runs eager attention for a family whose transformers class refuses SDPA (Gemma 2: its
    attention logit soft-capping), as transformers' own default does."""
    from transformers import AutoConfig

    resolved = resolve_target(name_or_path, home)
    try:
        torch_device = resolve_device(device)
    except ValueError as err:
        raise TargetLoadError(f"target {name_or_path}: {err}") from None
    torch_dtype = resolve_dtype(dtype, torch_device)
    where = resolved.location
    if resolved.kind == "folder":  # the embedded and GGUF targets are converted to safetensors; the hub's
        _require_safetensors(Path(where))  # are asked for with use_safetensors=True
    try:
        config = AutoConfig.from_pretrained(where, trust_remote_code=trust_remote_code)
        model_class = _model_class(config)
        attention = _attention_for(model_class, config, attn_implementation)
        if resolved.kind == "folder" and nvfp4_quantization(where) is not None:
            model = load_emulated(where, dtype=torch_dtype, mode=nvfp4_mode, attn_implementation=attention)
        else:
            model = from_pretrained_complete(
                model_class, where, dtype=torch_dtype, use_safetensors=True, attn_implementation=attention,
                trust_remote_code=trust_remote_code,
            )
    except (OSError, ValueError, KeyError, TypeError, ImportError) as err:
        raise TargetLoadError(f"{where}: cannot load as a causal LM ({type(err).__name__}: {err})") from err
    tokenizer = _load_tokenizer(where, trust_remote_code)
    if architecture:
        check_architecture(model.config, architecture, str(where))
    model.to(torch_device)
    try:
        target = Target(model, tokenizer, aux_layer_ids, name=resolved.spec)
    except ValueError as err:
        raise TargetLoadError(f"{where}: {err}") from err
    target.location = str(resolved.location)
    verify_capture(target, str(where))
    return target


def load_target_head(
    name_or_path: str,
    *,
    dtype: str = "auto",
    aux_layer_ids: Sequence[int] | None = None,
    trust_remote_code: bool = False,
    home: Path | None = None,
    architecture: dict[str, Any] | None = None,
) -> Target:
    """The target without its decoder layers, on CPU: config, tokenizer, and only the input
    embedding, final norm and lm_head read from the checkpoint (what training needs: a few GB
    for a 1T-parameter target, whose full load would not fit). The model is built on the meta
    device and those three modules alone are filled, so their classes are the architecture's own
    (Gemma's offset norm, Cohere's LayerNorm). ``forward`` is refused. Quantized checkpoints
    (NVFP4, FP8, INT4) work when these three tensors are stored unquantized, as they are in
    practice; otherwise the error names the tensor. A hub id downloads the config, tokenizer and
    the shards holding those tensors only."""
    from transformers import AutoConfig

    resolved = resolve_target(name_or_path, home)
    torch_dtype = resolve_dtype(dtype, torch.device("cpu"))
    where = _head_files(resolved.location, trust_remote_code) if resolved.kind == "hub" else resolved.location
    _require_safetensors(Path(where))
    try:
        config = AutoConfig.from_pretrained(where, trust_remote_code=trust_remote_code)
        if hasattr(config, "quantization_config"):  # the head is read as stored; nothing to quantize
            del config.quantization_config
        with torch.device("meta"):
            model = _model_class(config).from_config(config, dtype=torch_dtype, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, TypeError, ImportError) as err:
        raise TargetLoadError(f"{where}: cannot build the model of {where}/config.json "
                              f"({type(err).__name__}: {err})") from err
    if architecture:
        check_architecture(model.config, architecture, str(where))
    try:
        target = Target(model, _load_tokenizer(where, trust_remote_code), aux_layer_ids, name=resolved.spec)
    except ValueError as err:
        raise TargetLoadError(f"{where}: {err}") from err
    target.location = str(resolved.location)  # not the head-only download: the checkpoint the store names
    tied = target.lm_head.weight is target.embed_tokens.weight
    tensors = _checkpoint_tensors(Path(where))
    names = {id(module): name for name, module in model.named_modules()}
    for module in (target.embed_tokens, target.norm) if tied else (target.embed_tokens, target.norm, target.lm_head):
        for pname, param in list(module.named_parameters(recurse=False)):  # buffers stay on meta: never read
            key = _find_key(tensors, f"{names[id(module)]}.{pname}", where)
            scales = [k for k in (f"{key}_scale", f"{key}_scale_inv") if k in tensors]
            with safe_open(str(Path(where) / tensors[key]), framework="pt") as f:
                value = f.get_tensor(key)
            if scales or not value.dtype.is_floating_point or value.element_size() < 2:
                raise TargetLoadError(f"{where}: {key} is stored quantized ({value.dtype}"
                                      + (f", with {', '.join(scales)}" if scales else "")
                                      + "); training needs the target's embedding, final norm and lm_head unquantized")
            if value.shape != param.shape:
                raise TargetLoadError(f"{where}: {key} has shape {tuple(value.shape)}, the config implies "
                                      f"{tuple(param.shape)}")
            setattr(module, pname, nn.Parameter(value.to(torch_dtype), requires_grad=False))
    if tied:
        target.lm_head.weight = target.embed_tokens.weight
    target.head_only = True
    return target


def _model_class(config: Any) -> Any:
    """The auto class that builds ``config``: causal LM, else image-text-to-text (multimodal
    checkpoints such as Kimi-K2.5 or Qwen2.5-VL); the causal LM's error names an unknown one."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    for auto in (AutoModelForCausalLM, AutoModelForImageTextToText):
        if type(config) in auto._model_mapping:
            return auto
    auto_map = getattr(config, "auto_map", None) or {}  # the checkpoint's own code (trust_remote_code)
    return AutoModelForImageTextToText if "AutoModelForImageTextToText" in auto_map else AutoModelForCausalLM


def _attention_for(auto_class: Any, config: Any, requested: str) -> str:
    """``requested``, or ``eager`` where it is ``sdpa`` and the class ``auto_class`` builds for
    ``config`` cannot run SDPA (Gemma 2, whose attention soft-caps its logits: transformers refuses
    to load it with SDPA rather than compute something else)."""
    if requested != "sdpa":
        return requested
    concrete = auto_class._model_mapping[type(config)] if type(config) in auto_class._model_mapping else None
    return "eager" if concrete is not None and not getattr(concrete, "_supports_sdpa", True) else requested


def _require_safetensors(folder: Path) -> None:
    if not any(folder.glob("*.safetensors")):
        pickled = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
        detail = f"only pickled weights ({', '.join(pickled)})" if pickled else "no weights"
        raise TargetLoadError(
            f"{folder}: {detail}; targets load from safetensors only (pickles are never unpickled): "
            "save the model with save_pretrained(..., safe_serialization=True) first"
        )


def _load_tokenizer(where: str, trust_remote_code: bool) -> Any:
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(where, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise TargetLoadError(f"{where}: cannot load the tokenizer ({type(err).__name__}: {err})") from err
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


_SMALL_FILES = ["*.json", "*.jinja", "*.model", "*.tiktoken", "*.txt", "tokenizer*"]


def _head_files(repo_id: str, trust_remote_code: bool) -> str:
    """A local folder with a hub model's config, tokenizer (and code, with ``trust_remote_code``)
    and the shards of its embedding, final norm and lm_head (all of them without an index)."""
    from huggingface_hub import hf_hub_download, snapshot_download

    small = [*_SMALL_FILES, "*.py"] if trust_remote_code else _SMALL_FILES
    try:
        folder = Path(snapshot_download(repo_id, allow_patterns=small))
        index = folder / "model.safetensors.index.json"
        if not index.is_file():
            return snapshot_download(repo_id, allow_patterns=[*small, "*.safetensors"])
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        outside = [k for k in weight_map if not _LAYER_KEY.search(k)]  # a few tensors: embeddings, norms, heads
        for shard in sorted({weight_map[k] for k in outside}):
            hf_hub_download(repo_id, shard)
    except (OSError, ValueError, KeyError) as err:  # hub errors are OSErrors
        raise TargetLoadError(f"{repo_id}: cannot fetch the config, tokenizer and head shards "
                              f"({type(err).__name__}: {err})") from err
    return str(folder)
_LAYER_KEY = re.compile(r"\.(layers|h|blocks)\.\d+\.")


def _checkpoint_tensors(folder: Path) -> dict[str, str]:
    """Tensor name -> file (relative to ``folder``) of a safetensors checkpoint."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    tensors: dict[str, str] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            tensors.update(dict.fromkeys(f.keys(), file.name))
    return tensors


_LAYOUTS = (("model.language_model.", "language_model.model."), ("lm_head.", "language_model.lm_head."))
"""Module-name prefixes and how checkpoints of other layouts name the same tensor (transformers
renames these at load time: older multimodal checkpoints, Kimi-K2.5's among them)."""


def _find_key(tensors: dict[str, str], name: str, where: str) -> str:
    if name in tensors:
        return name
    for ours, theirs in _LAYOUTS:
        if name.startswith(ours) and theirs + name[len(ours):] in tensors:
            return theirs + name[len(ours):]
    leaf = name.split(".")[-2:]
    candidates = [k for k in tensors if k.split(".")[-2:] == leaf and not _LAYER_KEY.search(k)]
    if len(candidates) == 1:
        return candidates[0]
    raise TargetLoadError(f"{where}: no tensor for {name} in the checkpoint"
                          + (f" (candidates: {', '.join(sorted(candidates))})" if candidates else ""))


CAPTURE_TOLERANCE = 1e-3
"""Max relative error of :func:`verify_capture` in fp32 (ten times it in bf16/fp16): the capture
reads the very tensors HF computes, so a supported architecture shows ~0, except where a family
scales the hidden state before lm_head and we scale the logits after it (MiniCPM3: ~6e-3 in
bf16). A missing scale or cap shows as several percent."""


def verify_capture(target: Target, where: str) -> None:
    """Refuse a target whose capture or logits differ from the model's own on a short probe:
    the harvest would otherwise store wrong states or a wrong distribution without a sign."""
    vocab = min(target.vocab_size, target.embed_tokens.weight.shape[0])
    ids = (torch.arange(1, 9, device=target.device) * 7919 % vocab).unsqueeze(0)  # [1, 8]
    name = type(target.model).__name__
    try:
        errors = check_capture(target, ids)
    except (RuntimeError, TypeError, ValueError, AttributeError) as err:  # e.g. logits of another width
        raise TargetLoadError(f"{where}: {name}: the capture check failed ({type(err).__name__}: {err}); "
                              "this architecture is not supported") from err
    tolerance = CAPTURE_TOLERANCE * (1 if target.dtype == torch.float32 else 10)
    wrong = {key: value for key, value in errors.items() if key != "last_post_norm" and not value <= tolerance}
    if wrong:
        detail = ", ".join(f"{key} {value:.2e}" for key, value in wrong.items())
        raise TargetLoadError(
            f"{where}: {name} does not compute what the capture assumes (max relative "
            f"error vs its own forward: {detail}; tolerance {tolerance:g}). The logits must be "
            f"lm_head(norm(last layer output)) up to a known scale/softcap ({target.logit_transform}); "
            "this architecture is not supported")


def check_architecture(config: Any, expected: dict[str, Any], where: str, prefix: str = "") -> None:
    """Every value of ``expected`` (nested dicts for sub-configs such as ``text_config``) equals the
    loaded config's; otherwise a :class:`TargetLoadError` naming the key. The RoPE keys compare by
    meaning, in whichever spelling the recipe and the installed transformers use (``ROPE_KEYS``)."""
    differs = rope_difference(config, expected)
    if differs:
        key, want, got = differs
        raise TargetLoadError(f"{where}: target.architecture.{prefix}{ROPE_KEYS[0]}: {key}={want!r}, but the "
                              f"model's config has {got!r} (is the recipe for another model?)")
    for key, want in expected.items():
        if key in ROPE_KEYS:
            continue
        got = config.get(key) if isinstance(config, dict) else getattr(config, key, None)
        if isinstance(want, dict) and got is not None:  # a sub-config or dict: the keys given must match
            check_architecture(got, want, where, f"{prefix}{key}.")
        elif got != want:
            raise TargetLoadError(f"{where}: target.architecture.{prefix}{key}={want!r}, but the model's config "
                                  f"has {got!r} (is the recipe for another model?)")


_DECODER_PATHS = ("model", "model.language_model", "language_model.model", "language_model")
"""Where causal LMs keep their text decoder: ``.model`` (Llama, Qwen, DeepSeek), the language model
of a multimodal one (transformers' ``model.language_model``: Kimi-K2.5, Qwen2.5-VL, Gemma 3,
Mistral 3; ``language_model.model`` in older layouts). Only its text path is ever run."""


def _find_decoder(model: nn.Module) -> nn.Module:
    """The text decoder stack of a causal LM: needs ``layers``, ``norm`` and ``embed_tokens``."""
    arch = type(model).__name__
    for path in _DECODER_PATHS:
        decoder = model
        for part in path.split("."):
            decoder = getattr(decoder, part, None)
        if decoder is not None and all(hasattr(decoder, a) for a in ("layers", "norm", "embed_tokens")):
            break
    else:
        raise ValueError(
            f"unsupported architecture {arch}: expected a text decoder with .layers, .norm and .embed_tokens "
            f"at one of {', '.join('.' + p for p in _DECODER_PATHS)} (Llama, Qwen, Mistral, DeepSeek style)"
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
    errors["head_of_last"] = rel(target.head(out.last), ref.logits)  # what the harvest and trainer use
    return errors


__all__ = [
    "CAPTURE_TOLERANCE", "LogitTransform", "Target", "TargetLoadError", "TargetOutput", "TargetSourceError",
    "check_architecture", "check_aux_layer_ids", "check_capture", "verify_capture",
    "default_aux_layer_ids", "load_target", "load_target_head",
]
