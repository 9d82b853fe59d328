"""The trainer: an EAGLE-3 draft head on a harvest store, with the DeepSpeed engine.

    python -m eagle3.train --store runs/harvest --target smollm2-135m --out runs/train \\
        [--eval-store DIR | --eval-fraction 0.1] [--steps N] [--zero-stage 0..3] [--precision fp32|bf16|auto] ...
    torchrun --nproc_per_node 2 -m eagle3.train ...          # or: deepspeed --num_gpus 2 eagle3/train.py ...

What it wraps around the library (the draft and TTT code know nothing of this):

* **Distribution**: ``deepspeed.initialize(model, optimizer, lr_scheduler, config)`` with a
  torch ``AdamW`` (never a JIT-compiled fused optimiser), ZeRO 0-3, fp32 or bf16, gradient
  accumulation and clipping, linear warmup + cosine decay. One process, or several under
  ``torchrun`` / the ``deepspeed`` launcher; gloo on CPU, nccl on CUDA; the device is chosen
  once in :func:`init_runtime`. On CPU DeepSpeed JIT-builds its ``shm_comm`` op on the first
  start (~50-90 s); ``TORCH_EXTENSIONS_DIR`` defaults to ``$EAGLE3_HOME/torch_extensions`` so
  it is built once per machine.
* **Data** (:mod:`eagle3.train_data`): the training store (checked against the target), an
  optional held-out store or an id-hash split; packed or length-bucketed micro-batches,
  reshuffled per epoch and sharded by rank deterministically.
* **Targets**: the target's frozen final norm + lm_head turn the stored pre-norm ``last``
  states into its next-token distribution (or a top-k store's log-probs are used).
* **Draft vocab**: the ``draft_vocab_size`` most frequent loss-masked tokens of the training
  split, chosen once and saved as ``out_dir/draft_vocab.safetensors`` (frozen for the run,
  reusable by another run with ``draft_vocab=PATH``).
* **Loss and metrics**: :func:`eagle3.ttt.ttt_forward` (K=7 steps, weights 0.8**k), per-step
  accuracy, conditional acceptance and tau_sim on train batches and on the eval split every
  ``eval_every`` steps; the best eval tau_sim is exported to ``out_dir/best``.
* **Checkpoints** (:mod:`eagle3.checkpoint`): DeepSpeed's, with the data position, best eval
  and per-rank RNG states, published atomically; a run killed at any moment resumes to the
  same losses. ``out_dir/final`` holds the last draft.
* **Logging** (:mod:`eagle3.train_log`): ``metrics.jsonl`` and wandb (offline by default)
  from rank 0, a tqdm bar on rank 0.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
import socket
import sys
import time
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from eagle3.atomic import remove_leftovers, sha256_file
from eagle3.checkpoint import (
    export_draft,
    latest_tag,
    load_checkpoint,
    read_draft_vocab,
    read_trainer_state,
    remove_partial,
    save_checkpoint,
    seed_everything,
    write_draft_vocab,
)
from eagle3.config import LR_SCHEDULES, TargetConfig, TrainConfig
from eagle3.draft import DraftConfig, Eagle3Draft, trainable_parameter_count
from eagle3.draft_vocab import DraftVocab, select_draft_vocab
from eagle3.errors import USER_ERRORS, Eagle3Error
from eagle3.export import nonfinite_tensors
from eagle3.home import eagle3_home
from eagle3.shards import HarvestStore, StoreError, StoreUnion, open_stores, store_state, verify_store
from eagle3.target import LogitTransform, Target, bf16_matmul_speedup, load_target_head
from eagle3.train_data import (
    epoch_batches,
    eval_batches_for_rank,
    load_batch,
    loss_token_counts,
    rank_batch_index,
    split_by_id,
    steps_per_epoch,
    weighted_indices,
)
from eagle3.train_log import NullSink, RunSink, print0
from eagle3.ttt import TTTOutput, TTTTargets, prepare_targets, prepare_targets_from_topk, step_weights, ttt_forward


class TrainError(Eagle3Error, RuntimeError):
    """Training cannot start or go on; the message names the setting, store or file."""


# ---------------------------------------------------------------- runtime: device and processes


@dataclass(frozen=True)
class Runtime:
    device: torch.device
    rank: int
    world_size: int
    local_rank: int


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_runtime(device: str = "auto") -> Runtime:
    """Choose the device once and join (or create) the process group: gloo on CPU, nccl on CUDA.

    Without a launcher this is a group of one (the rendezvous variables are filled in). Run again
    in the same process, it reuses the existing group.
    """
    use_cuda = torch.cuda.is_available() if device == "auto" else device.startswith("cuda")
    if use_cuda and not torch.cuda.is_available():
        raise TrainError(f"train.device={device!r}, but CUDA is not available")
    if not use_cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(eagle3_home() / "torch_extensions"))
    dist = torch.distributed
    if dist.is_initialized():  # an earlier call in this process
        rank, world = dist.get_rank(), dist.get_world_size()
        local = int(os.environ.get("LOCAL_RANK", "0"))
    else:
        if "RANK" not in os.environ:  # no launcher: a group of one
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(_free_port()))
        rank, world, local = (int(os.environ.get(k, "0")) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if use_cuda:
        index = int(device.split(":")[1]) if ":" in device else local
        torch_device = torch.device("cuda", index)
        torch.cuda.set_device(torch_device)
    else:
        torch_device = torch.device("cpu")
    import deepspeed

    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if use_cuda else "gloo", verbose=False)
    return Runtime(device=torch_device, rank=rank, world_size=world, local_rank=local)


def _all_reduce_sum(x: Tensor) -> Tensor:
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(x)
    return x


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


# ---------------------------------------------------------------- schedule, targets, the engine's module


def warmup_decay(warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.0,
                 kind: str = "cosine") -> Callable[[int], float]:
    """LR factor of optimizer step s (0-based): (s+1)/warmup, then ``kind`` (cosine or linear)
    from 1 to ``min_lr_ratio`` at the last step, or constant 1."""
    if kind not in LR_SCHEDULES:
        raise ValueError(f"lr schedule {kind!r}: expected one of {', '.join(LR_SCHEDULES)}")

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if kind == "cosine" else 1.0 - progress
        return min_lr_ratio + (1.0 - min_lr_ratio) * shape

    return factor


class TargetHead(nn.Module):
    """The target's frozen final norm + lm_head (+ logit transform): stored pre-norm states -> its distribution."""

    def __init__(self, norm: nn.Module, lm_head: nn.Module, transform: LogitTransform | None = None,
                 temperature: float = 1.0) -> None:
        super().__init__()
        if not temperature > 0:
            raise ValueError(f"target temperature {temperature}: must be > 0")
        self.norm, self.lm_head = norm, lm_head
        self.transform = transform or LogitTransform()
        self.temperature = temperature  # divides the (transformed) logits of the distribution, not the argmax
        self.requires_grad_(False)
        self._split: tuple[Any, ...] | None = None
        self._split_pays = True  # turned off when most rows need the full product anyway

    @torch.no_grad()
    def targets(self, batch: dict[str, Tensor], t2d: Tensor, chunk_tokens: int = 1024) -> TTTTargets:
        """TTT targets [B, S, Vd] for a batch with ``last`` [B, S, H] or ``topk_ids``/``topk_logprobs``.

        The target's distribution p[t] (over x[t+1]) is only ever read where x[t+1] is a
        loss-masked token of the same document (every step's loss and metrics are gated by
        that, see :func:`eagle3.ttt.step_counted`), so the head runs on those rows only, in
        chunks: the full-vocab logits never exist for the whole batch. Other rows get zero
        probabilities and argmax -1 (never counted).
        """
        if "last" not in batch:
            return prepare_targets_from_topk(batch["topk_ids"], batch["topk_logprobs"], t2d, self.temperature)
        last, mask, doc = batch["last"], batch["loss_mask"].bool(), batch["document_ids"]  # [B, S, H], [B, S]
        b, s, h = last.shape
        needed = torch.zeros_like(mask)  # [B, S]
        needed[:, :-1] = mask[:, 1:] & (doc[:, 1:] == doc[:, :-1])
        rows = needed.flatten().nonzero().squeeze(1)  # [N]
        flat = last.reshape(b * s, h)[rows].to(self.lm_head.weight.dtype)  # [N, H]
        vd = int(t2d.sum())
        probs = torch.zeros(b * s, vd, dtype=torch.float32, device=last.device)  # [B*S, Vd]
        argmax = torch.full((b * s,), -1, dtype=torch.long, device=last.device)  # [B*S]
        for i in range(0, len(rows), chunk_tokens):
            x = self.norm(flat[i:i + chunk_tokens])
            split = (self._split_pays and self.lm_head.weight.dtype == torch.float32
                     and getattr(self.lm_head, "bias", None) is None
                     and bf16_matmul_speedup(x.device.type) > 1.0)  # its rough pass is bf16
            part = (self._split_targets(x, t2d) if split
                    else prepare_targets(self.transform(self.lm_head(x)), t2d, temperature=self.temperature))
            probs[rows[i:i + chunk_tokens]] = part.probs
            argmax[rows[i:i + chunk_tokens]] = part.argmax
        return TTTTargets(probs=probs.view(b, s, vd), argmax=argmax.view(b, s))

    @classmethod
    def of_target(cls, target: Target, temperature: float = 1.0) -> TargetHead:
        """A copy of ``target``'s head (the target itself can then be freed). The capture hook on
        the target's norm is dropped: copying it would copy the whole target through the hook."""
        memo = {id(target): target}
        norm, lm_head = copy.deepcopy(target.norm, memo), copy.deepcopy(target.lm_head, memo)
        for module in (norm, lm_head):
            module._forward_pre_hooks.clear()
            module._forward_pre_hooks_with_kwargs.clear()
        return cls(norm, lm_head, target.logit_transform, temperature)

    def _split_targets(self, x: Tensor, t2d: Tensor, groups: int = 16) -> TTTTargets:
        """:func:`prepare_targets` of ``lm_head(x)`` (fp32) without most of the full-vocab product.

        The distribution needs only the draft-vocab rows of the head, computed in fp32 as
        before. The argmax needs the rest only to learn whether some token outside the draft
        vocab beats the best one inside: those logits are computed in bf16 (several times
        faster on CPUs with bf16 units; used only where bf16 is measured faster, see
        :func:`eagle3.target.bf16_matmul_speedup`) with a rigorous bound on their error,
        ``|bf16 - fp32| <= c * |x| * |w_j|`` (bf16 rounding of both operands and of the
        result, fp32 accumulation, Cauchy-Schwarz), taken per group of outside rows of similar
        norm; only the rows the bound cannot settle (~7% on the default target) get their
        outside logits recomputed in fp32. The result equals ``prepare_targets``'s, ties
        included (the lower token id wins, as in ``argmax``); the argmax is taken before the
        target's logit transform (increasing), so only logits a soft cap rounds to equal
        values could order differently.
        """
        w = self.lm_head.weight  # [V, H]
        if self._split is None or self._split[0].shape != t2d.shape or not torch.equal(self._split[0], t2d):
            inside = t2d.to(w.device)
            outside = (~inside).nonzero().squeeze(1)  # [Vo] target ids
            norms = w[outside].norm(dim=-1)
            order = norms.argsort(descending=True)  # groups of similar norm: a tighter bound per group
            outside, norms = outside[order], norms[order]
            w_out = w[outside].contiguous()  # [Vo, H]
            edges = torch.linspace(0, len(outside), groups + 1).long().tolist()
            cuts = [(lo, hi) for lo, hi in zip(edges[:-1], edges[1:], strict=True) if hi > lo]
            group_norm = torch.stack([norms[lo:hi].max() for lo, hi in cuts]) if cuts else norms[:0]
            self._split = (t2d.clone(), inside.nonzero().squeeze(1), outside, w[inside].contiguous(), w_out,
                           w_out.bfloat16(), group_norm, cuts)
        _, in_ids, out_ids, w_in, w_out, w_out_bf16, group_norm, cuts = self._split
        logits_in = x @ w_in.T  # [N, Vd] fp32, before the transform (increasing: the argmax logic holds)
        probs = torch.nan_to_num(torch.softmax(self.transform(logits_in) / self.temperature, dim=-1), nan=0.0)
        best_in, arg_in = logits_in.max(-1)  # [N]: the first maximum, i.e. the lowest id
        id_in = in_ids[arg_in]
        if len(out_ids) == 0:
            return TTTTargets(probs=probs, argmax=id_in)
        u, n = 2.0**-8, x.shape[-1]  # bf16's unit roundoff; fp32 accumulation adds n * 2^-24 twice
        c = 4 * u + 2 * n * 2.0**-24
        rough = x.bfloat16() @ w_out_bf16.T  # [N, Vo] bf16
        group_max = torch.stack([rough[:, lo:hi].amax(-1) for lo, hi in cuts], dim=-1).float()  # [N, G]
        bound = c * x.norm(dim=-1, keepdim=True) * group_norm  # [N, G]
        unsettled = ((group_max + bound).amax(-1) >= best_in).nonzero().squeeze(1)
        if len(x) >= 256 and len(unsettled) > len(x) // 2:  # e.g. a tiny draft vocab: most argmaxes outside
            self._split_pays = False
        # Settled rows: every outside logit is below the best inside one, whatever their argmax.
        argmax = id_in.clone()
        if len(unsettled):
            exact = x[unsettled] @ w_out.T  # [M, Vo] fp32, as the full product
            best_out = exact.amax(-1)
            # Among equal maxima argmax takes the lowest id; out_ids is sorted by norm, not id.
            id_out = torch.where(exact == best_out.unsqueeze(1), out_ids, out_ids.max() + 1).amin(-1)
            b_in, i_in = best_in[unsettled], id_in[unsettled]
            wins_in = (b_in > best_out) | ((b_in == best_out) & (i_in < id_out))
            argmax[unsettled] = torch.where(wins_in, i_in, id_out)
        return TTTTargets(probs=probs, argmax=argmax)


def add_feature_noise(aux: Tensor, scale: float) -> Tensor:
    """aux [.., A, H_t] plus Gaussian noise whose std is ``scale`` times each state's RMS (the
    target's layers differ in scale by orders of magnitude, so an absolute noise would drown the
    shallow states and miss the deep ones). Drawn from torch's global generator, which
    checkpoints save and restore."""
    x = aux.float()
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()  # [.., A, 1]
    return (x + scale * rms * torch.randn_like(x)).to(aux.dtype)


class TTTModel(nn.Module):
    """The module the DeepSpeed engine wraps: the draft and its TTT unroll; returns tensors only."""

    def __init__(self, draft: Eagle3Draft, num_steps: int, step_decay: float,
                 gradient_checkpointing: bool = False, loss_on_oov: bool = False, feature_noise: float = 0.0,
                 gate_steps: bool = False) -> None:
        super().__init__()
        self.draft = draft
        self.loss_on_oov = loss_on_oov
        self.gate_steps = gate_steps
        self.feature_noise = feature_noise
        self.num_steps = num_steps
        self.weights = step_weights(num_steps, step_decay)
        self.gradient_checkpointing = gradient_checkpointing

    def forward(self, input_ids: Tensor, aux: Tensor, position_ids: Tensor, document_ids: Tensor,
                loss_mask: Tensor, target_probs: Tensor, target_argmax: Tensor) -> tuple[Tensor, ...]:
        if self.training and self.feature_noise > 0:
            aux = add_feature_noise(aux, self.feature_noise)
        out = ttt_forward(self.draft, input_ids, aux, position_ids, document_ids, loss_mask,
                          TTTTargets(probs=target_probs, argmax=target_argmax), num_steps=self.num_steps,
                          weights=self.weights, gradient_checkpointing=self.gradient_checkpointing and self.training,
                          loss_on_oov=self.loss_on_oov, gate_steps=self.gate_steps)
        return out.loss, out.loss_sum, out.count, out.match, out.counted


def _run(engine: Any, head: TargetHead, batch: dict[str, Tensor], t2d: Tensor, dtype: torch.dtype,
         device: torch.device) -> TTTOutput:
    """One batch (as the loader builds it, on the host) through the engine on ``device``."""
    batch = {k: v.to(device) for k, v in batch.items()}
    targets = head.targets(batch, t2d)
    loss, loss_sum, count, match, counted = engine(batch["input_ids"], batch["aux"].to(dtype), batch["position_ids"],
                                                   batch["document_ids"], batch["loss_mask"], targets.probs,
                                                   targets.argmax)
    return TTTOutput(loss=loss, loss_sum=loss_sum, count=count, match=match, counted=counted, valid=counted)


def train_forward(engine: Any, head: TargetHead, batch: dict[str, Tensor], t2d: Tensor, dtype: torch.dtype,
                  device: torch.device, loss_positions: str = "replies") -> tuple[TTTOutput, Tensor]:
    """A training micro-batch's forward: its output and its [loss, tokens] (float64, on ``device``,
    to be summed over micro-batches and ranks without a host sync)."""
    batch = {k: v.to(device) for k, v in batch.items()}
    if loss_positions == "all":
        batch["loss_mask"] = batch["document_ids"] >= 0  # [B, S] every token, padding excepted
    out = _run(engine, head, batch, t2d, dtype, device)
    return out, torch.stack([out.loss.detach().double(), (batch["document_ids"] >= 0).sum().double()])


# ---------------------------------------------------------------- metrics over many batches and ranks


class AcceptanceTally:
    """Sums behind per-step accuracy, conditional acceptance and tau_sim (as in :mod:`eagle3.ttt`),
    so that batches and ranks can be added up before the ratios are taken."""

    def __init__(self, num_steps: int, device: torch.device) -> None:
        self.k = num_steps
        # hits, counted, upto, before, loss_sum, loss_count [K] each; then accepted, starts
        self.values = torch.zeros(6 * num_steps + 2, dtype=torch.float64, device=device)

    def add(self, out: TTTOutput) -> None:
        k = self.k
        hit = (out.match & out.counted).flatten(1).long()  # [K, N]
        upto = torch.cumprod(hit, dim=0)  # [K, N] steps 0..k all matched
        before = torch.cat([torch.ones_like(upto[:1]), upto[:-1]]).bool() & out.counted.flatten(1)  # [K, N]
        start = out.counted[0].flatten()  # [N]
        v = self.values
        v[0:k] += hit.sum(1)
        v[k:2 * k] += out.counted.flatten(1).sum(1)
        v[2 * k:3 * k] += upto.sum(1)
        v[3 * k:4 * k] += before.sum(1)
        v[4 * k:5 * k] += out.loss_sum.detach().double()
        v[5 * k:6 * k] += out.count.double()
        v[6 * k] += upto.sum(0)[start].sum()
        v[6 * k + 1] += start.sum()

    def all_reduce(self) -> AcceptanceTally:
        _all_reduce_sum(self.values)
        return self

    def summary(self, weights: Tensor, prefix: str) -> dict[str, float]:
        k, v = self.k, self.values.cpu()
        acc = v[0:k] / v[k:2 * k].clamp_min(1)
        cond = v[2 * k:3 * k] / v[3 * k:4 * k].clamp_min(1)
        step_loss = v[4 * k:5 * k] / v[5 * k:6 * k].clamp_min(1)
        tau = 1.0 + float(v[6 * k] / v[6 * k + 1]) if v[6 * k + 1] > 0 else 1.0
        out = {f"{prefix}/loss": float((weights * step_loss).sum()), f"{prefix}/tau_sim": tau,
               f"{prefix}/positions": int(v[6 * k + 1])}
        out |= {f"{prefix}/acc_{i}": float(acc[i]) for i in range(k)}
        out |= {f"{prefix}/cond_acc_{i}": float(cond[i]) for i in range(k)}
        return out


# ---------------------------------------------------------------- setup pieces


def muon_ns_method(setting: str, device: torch.device | str) -> str:
    """``auto`` -> DeepSpeed's Gram Newton-Schulz on CUDA, the original bf16 one elsewhere."""
    if setting != "auto":
        return setting
    return "gram" if torch.device(device).type == "cuda" else "standard"


def resolve_precision(cfg: TrainConfig, device: torch.device) -> str:
    """``train.precision``, with ``auto`` made fp32 or bf16 for this device (see TrainConfig)."""
    if cfg.precision != "auto":
        return cfg.precision
    fast = device.type == "cuda" or (device.type == "cpu" and bf16_matmul_speedup("cpu") > 1.0)
    return "bf16" if fast and not (cfg.optimizer == "muon" and cfg.zero_stage == 0) else "fp32"


def muon_ns_in_fp32_where_bf16_is_slow(device: torch.device | str) -> bool:
    """On a CPU without bf16 units, make DeepSpeed's Newton-Schulz run in fp32; True if it did.

    DeepSpeed runs the iteration in bf16 (fp16 for ``gram``) whenever its accelerator reports
    support, which its CPU accelerator always does; on an AVX2-only CPU those products ran
    ~170x slower than fp32 and Muon took most of each step. Its iteration reads
    ``original_muon.ns_compute_dtype`` at every call, so this replaces that lookup (process-wide)
    with fp32, which is only more precise.
    """
    if torch.device(device).type != "cpu" or bf16_matmul_speedup("cpu") > 1.0:
        return False
    from deepspeed.runtime.zero.muon import original_muon

    original_muon.ns_compute_dtype = lambda ns_method="gram": torch.float32
    return True


def unclip_muon_updates_under_zero(engine: Any) -> bool:
    """Stop DeepSpeed's ZeRO optimizer from clipping Muon's updates; True if the engine has one.

    Under ZeRO (stages 1-3, except bf16 at stage 1, which takes DeepSpeed's BF16 optimizer)
    DeepSpeed orthogonalises each Muon matrix's gradient while it reduces it and then
    clips by the global norm of what it holds: the orthogonalised updates, whose norm is ~20-60
    for any gradient. With ``max_grad_norm=0.5`` every Muon step shrank ~40-100x (measured:
    SmolLM2 drafts trained at ZeRO 1 in fp32 learnt far less than at ZeRO 0 or in bf16 at ZeRO 1,
    whose losses match each other). Those updates are normalised already, so nothing of value is lost
    without that clip; the auxiliary AdamW's gradients are not clipped either in this set-up.
    """
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    zero = engine.optimizer
    if not isinstance(zero, DeepSpeedZeroOptimizer | DeepSpeedZeroOptimizer_Stage3):
        return False
    zero.clip_grad = 0.0
    return True


def muon_param_groups(model: nn.Module, lr: float, ns_method: str = "gram") -> list[dict[str, Any]]:
    """Trainable parameters tagged for DeepSpeed's Muon, one group per Muon matrix.

    Muon takes the hidden 2-D matrices (fc, attention, MLP); lm_head (an output layer) and the
    norms go to the auxiliary AdamW at ``lr``. DeepSpeed's orthogonalised step for a
    [out, in] matrix has an RMS of about 1/sqrt(in) per unit lr; each matrix's lr is set so that
    the step's RMS is 0.2 * lr, the RMS of an AdamW step (speculators' ``match_rms_adamw``), so
    warmup and decay act on both halves alike. ``ns_method`` is DeepSpeed's Newton-Schulz variant
    for each Muon group (see :func:`muon_ns_method`).
    """
    groups: list[dict[str, Any]] = []
    adam: list[nn.Parameter] = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            p.use_muon = False
            continue
        p.use_muon = p.ndim == 2 and "lm_head" not in name
        if p.use_muon:
            groups.append({"params": [p], "lr": 0.2 * lr * math.sqrt(p.shape[1]), "name": name,
                           "ns_method": ns_method})
        else:
            adam.append(p)
    return [*groups, {"params": adam, "lr": lr, "name": "adamw"}]


def deepspeed_config(cfg: TrainConfig, world_size: int) -> dict[str, Any]:
    optimizer: dict[str, Any] = {}
    zero: dict[str, Any] = {"stage": cfg.zero_stage}
    if cfg.optimizer == "muon":
        zero["reduce_scatter"] = False  # DeepSpeed's Muon needs each matrix's whole gradient (it refuses otherwise)
        optimizer = {
            "optimizer": {"type": "Muon", "params": {
                "lr": cfg.lr, "momentum": cfg.muon_momentum, "betas": [cfg.adam_beta1, cfg.adam_beta2],
                "eps": cfg.adam_eps, "weight_decay": cfg.weight_decay, "torch_adam": True}},
            "data_types": {"grad_accum_dtype": "fp32"},
        }
    return {
        **optimizer,
        "train_micro_batch_size_per_gpu": 1,  # one micro-batch = one packed row / bucket
        "gradient_accumulation_steps": cfg.gradient_accumulation,
        "train_batch_size": cfg.gradient_accumulation * world_size,
        "gradient_clipping": cfg.max_grad_norm,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,  # a torch AdamW: nothing JIT-compiled
        "bf16": {"enabled": cfg.precision == "bf16"},
        "steps_per_print": 10**12,
        "wall_clock_breakdown": False,
    }


def choose_draft_vocab(cfg: TrainConfig, store: HarvestStore | StoreUnion, train_idx: Sequence[int], vocab_size: int,
                       always_include: Sequence[int], initial: Eagle3Draft | None = None) -> DraftVocab:
    """The vocab of the draft training continues from (``initial``), a saved vocab
    (``cfg.draft_vocab``), or the most frequent loss-masked tokens of the training split."""
    if initial is not None:  # the draft's own vocab, whatever its format keeps of it
        try:
            return DraftVocab.from_d2t(initial.d2t, vocab_size)
        except ValueError as err:
            raise TrainError(f"train.init_draft: {err}") from None
    if cfg.draft_vocab:
        try:
            vocab = read_draft_vocab(cfg.draft_vocab, vocab_size)
        except (OSError, ValueError) as err:  # DraftFormatError is a ValueError
            raise TrainError(f"train.draft_vocab: {err}") from None
        if vocab.size != min(cfg.draft_vocab_size, vocab_size):
            print0(f"train.draft_vocab: {cfg.draft_vocab} holds {vocab.size} tokens; they replace "
                   f"train.draft_vocab_size={cfg.draft_vocab_size}")
        return vocab
    counts = loss_token_counts(store, train_idx, vocab_size)
    return select_draft_vocab(counts, min(cfg.draft_vocab_size, vocab_size), always_include)


def pinned_settings(cfg: TrainConfig, world_size: int, store: HarvestStore | StoreUnion,
                    eval_store: HarvestStore | None = None) -> dict[str, Any]:
    """What a resumed run must share with the run that saved the checkpoint: the settings that
    decide the data order, the model and how DeepSpeed sharded its states."""
    keys = ("batching", "micro_batch_tokens", "gradient_accumulation", "seed", "eval_fraction", "ttt_steps",
            "init_draft", "num_layers", "draft_intermediate_size", "draft_num_attention_heads",
            "draft_num_key_value_heads", "draft_head_dim", "draft_rope", "draft_variant", "zero_stage", "precision",
            "freeze_lm_head", "optimizer", "muon_momentum", "lm_head_init", "layer_init", "step_decay",
            "draft_vocab_size", "draft_vocab",
            # a checkpoint restores the optimizer's own lr, decay, betas and eps: a change would only be logged
            "lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps")
    pinned = {f"train.{k}": getattr(cfg, k) for k in keys}
    weights = sha256_file(Path(cfg.sample_weights)) if cfg.sample_weights else None
    held_out = ([entry["sha256"] for entry in eval_store.manifest["shards"]]  # the best draft is picked on it
                if eval_store is not None and eval_store is not store else None)
    return {**pinned, "world_size": world_size, "store.samples": len(store),
            "store.shards": [entry["sha256"] for entry in store.manifest["shards"]], "sample_weights": weights,
            "eval_store.shards": held_out}


def _read_sample_weights(path: str | None) -> dict[str, float]:
    if not path:
        return {}
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise TrainError(f"train.sample_weights={path}: {err}") from None
    if not isinstance(data, dict) or not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0
                                             for v in data.values()):
        raise TrainError(f"train.sample_weights={path}: expected a JSON object of sample id -> finite weight >= 0")
    return {str(k): float(v) for k, v in data.items()}


def check_pinned(saved: dict[str, Any], now: dict[str, Any], out_dir: Path) -> None:
    """Keys one side lacks (pinned by an earlier or later version) are not compared."""
    for key in sorted(set(saved) & set(now)):
        if saved.get(key) != now.get(key):
            shown = (lambda v: f"{str(v)[:60]}...") if key.endswith(".shards") else repr
            raise TrainError(f"{out_dir} was trained with {key}={shown(saved.get(key))}, this run has "
                             f"{shown(now.get(key))}; use the same settings to resume, or another out_dir "
                             "(or --no-resume to start over)")


VERIFIED = "verified_stores.json"


def verify_stores(roots: Sequence[str], record: Path, rt: Runtime) -> list[str]:
    """Every shard of ``roots`` checked against its manifest (sha256, tensor shapes) before the run
    reads a sample, the shards split over the ranks. A store this run has verified and that is
    unchanged since (its manifest, each shard's size and modification time, kept in ``record``) is
    not hashed again, so a resume costs nothing. Returns the stores hashed now."""
    try:
        known = json.loads(record.read_text()) if record.is_file() else {}
    except ValueError:
        known = {}
    states = {root: store_state(root) for root in dict.fromkeys(roots)}
    todo = [root for root, state in states.items() if not state or known.get(os.path.realpath(root)) != state]
    bad: StoreError | None = None
    for root in todo:
        try:
            verify_store(root, (rt.rank, rt.world_size))
        except StoreError as err:
            bad = err
            break
    failed = _all_reduce_sum(torch.tensor([float(bad is not None)], device=rt.device))
    if bad is not None:
        raise TrainError(f"{bad}; nothing was trained (python -m data_gen.harvest verify <store> checks a store)")
    if failed.item():
        raise TrainError("a store failed its verification on another rank (its message names the shard); "
                         "nothing was trained")
    if rt.rank == 0 and todo:
        from eagle3.atomic import atomic_write_text

        record.parent.mkdir(parents=True, exist_ok=True)
        known |= {os.path.realpath(root): states[root] for root in todo if states[root]}
        atomic_write_text(record, json.dumps(known, indent=1) + "\n")
    return todo


def _load_target(target_cfg: TargetConfig, aux_layer_ids: Sequence[int]) -> Target:
    if target_cfg.aux_layer_ids is not None and sorted(target_cfg.aux_layer_ids) != sorted(aux_layer_ids):
        raise TrainError(f"target.aux_layer_ids={target_cfg.aux_layer_ids}, but the store was harvested with "
                         f"{list(aux_layer_ids)}")
    # training reads only the target's embedding, final norm and lm_head (a few GB for a 1T model)
    return load_target_head(target_cfg.name_or_path, dtype=target_cfg.dtype, aux_layer_ids=aux_layer_ids,
                            trust_remote_code=target_cfg.trust_remote_code, architecture=target_cfg.architecture)


def _check_weights(target: Target, spec: Any) -> None:
    """The store's states must come from these weights: a sibling checkpoint with the same
    tokenizer and shapes (base and instruct, BF16 and NVFP4) passes every other check."""
    from eagle3.fingerprint import UNKNOWN_WEIGHTS, weights_fingerprint

    mine = weights_fingerprint(target.location)
    known = mine not in UNKNOWN_WEIGHTS and spec.weights_fingerprint not in UNKNOWN_WEIGHTS
    if known and mine != spec.weights_fingerprint:
        raise TrainError(f"target.name_or_path={target.name}: not the weights the store was harvested "
                         f"from (the store names {spec.target}, weights fingerprint {spec.weights_fingerprint[:12]}, "
                         f"these {mine[:12]}); train with the target that harvested it")


def _initial_draft(folder: str, spec: Any, target: Target, embedding: Tensor) -> Eagle3Draft:
    """A draft to continue training, checked against the store and the target."""
    from eagle3.export import DraftFormatError, check_draft_fits_target, give_target_lm_head, load_draft

    try:  # the target's embedding goes in once the draft is known to fit it
        loaded = load_draft(folder)
        check_draft_fits_target(loaded, hidden_size=target.hidden_size, vocab_size=target.vocab_size,
                                aux_layer_ids=spec.aux_layer_ids)
    except DraftFormatError as err:
        raise TrainError(f"train.init_draft: {err}") from None
    own = loaded.draft.embed_tokens.weight.detach().clone() if loaded.has_embedding else None
    try:  # a checkpoint's own copy is kept out: the target's embedding is the one served
        loaded.draft.load_embedding(embedding)
    except ValueError as err:
        raise TrainError(f"train.init_draft: {folder}: hidden_size={loaded.draft.config.hidden_size} cannot take "
                         f"the target's embedding ({err})") from None
    if own is not None:
        served = loaded.draft.embed_tokens.weight.detach().float()
        if not any(torch.equal(own.float(), served.to(dtype).float())  # the same, stored rounded
                   for dtype in (torch.float32, torch.bfloat16, torch.float16)):
            print0(f"train.init_draft: {folder} carries its own embedding, which differs from the target's (max "
                   f"|difference| {(own.float() - served).abs().max():.3g}); the draft trains and is exported "
                   "with the target's, as engines serve a draft without one")
    if not loaded.has_lm_head:
        print0(f"train.init_draft: {folder} has no lm_head; it starts from the target's (as engines serve it)")
        try:
            give_target_lm_head(loaded, target.lm_head.weight)
        except DraftFormatError as err:
            raise TrainError(f"train.init_draft: {err}") from None
    if loaded.aux_layer_ids is None:
        print0(f"train.init_draft: {folder} names no aux layer ids; assuming the store's {list(spec.aux_layer_ids)}")
    return loaded.draft.float()


def _draft_state(draft: Eagle3Draft, zero_stage: int) -> dict[str, Tensor]:
    """The full draft state on CPU (gathered from the ranks under ZeRO-3; a collective then)."""
    if zero_stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(draft.parameters()), modifier_rank=None):
            return {k: v.detach().cpu().clone() for k, v in draft.vllm_state_dict().items()}
    return {k: v.detach().cpu().clone() for k, v in draft.vllm_state_dict().items()}


def _stop_if_not_finite(weights: dict[str, Tensor], step: int) -> None:
    """Refuse to export a draft whose weights went NaN/Inf (the update after the last finite loss)."""
    if bad := nonfinite_tensors(weights):
        raise TrainError(f"step {step}: NaN/Inf in {', '.join(bad[:4])}; stopping before a non-finite draft is "
                         "exported (check the store's states, train.init_draft and train.lr)")


def _grad_norm(engine: Any, params: Sequence[nn.Parameter]) -> float | None:
    """The global grad norm DeepSpeed clipped with; computed here where DeepSpeed does not keep
    it (ZeRO 0 in fp32: the gradients are whole and already averaged over ranks)."""
    norm = engine.get_global_grad_norm()
    if norm is not None:
        return float(norm)
    grads = [p.grad for p in params if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads)) if grads else None


# ---------------------------------------------------------------- the loop


def train(cfg: TrainConfig, target_cfg: TargetConfig | None = None, *, target: Target | None = None) -> dict[str, Any]:
    """Train (or resume) a draft head; returns a summary. Every rank calls this."""
    import deepspeed
    from tqdm import tqdm

    target_cfg = target_cfg or TargetConfig()
    if not cfg.store or not cfg.out_dir:
        raise TrainError("train.store and train.out_dir must be set")
    started = time.perf_counter()
    rt = init_runtime(cfg.device)
    if rt.device.type == "cpu":
        torch.set_num_threads(cfg.threads)
    cfg = replace(cfg, precision=resolve_precision(cfg, rt.device))
    out_dir = Path(cfg.out_dir)
    ckpt_root = out_dir / "checkpoints"

    # -- data
    try:
        store = open_stores([cfg.store, *cfg.extra_stores])
    except StoreError as err:
        base_ok = (Path(cfg.store) / "manifest.json").is_file()
        key = "train.extra_stores" if cfg.extra_stores and base_ok else "train.store"
        raise TrainError(f"{key}: {err}") from None
    if len(set(map(os.path.realpath, [cfg.store, *cfg.extra_stores]))) <= len(cfg.extra_stores):
        raise TrainError(f"train.extra_stores={list(cfg.extra_stores)}: a store is named twice (train.store="
                         f"{cfg.store}); its samples would count double")
    spec = store.spec
    weights_by_id = _read_sample_weights(cfg.sample_weights)
    if target is None:
        target = _load_target(target_cfg, spec.aux_layer_ids)
    _check_weights(target, spec)
    store.check_target(target)
    sample_ids = set(store.sample_ids)
    if weights_by_id and not set(weights_by_id) & sample_ids:
        raise TrainError(f"train.sample_weights={cfg.sample_weights}: none of its ids is a sample of the training "
                         f"store (e.g. {next(iter(weights_by_id))!r}; the store's: {store.sample_ids[:1]})")
    if weights_by_id and not any(weights_by_id.get(i, 1.0) > 0 for i in sample_ids):  # unlisted: 1
        raise TrainError(f"train.sample_weights={cfg.sample_weights}: every sample's weight is 0; nothing to train on")
    if unknown := len(set(weights_by_id) - sample_ids):
        print0(f"train.sample_weights: {unknown} of {len(weights_by_id)} ids are not samples of the training store")
    if cfg.eval_store:
        try:
            eval_store: HarvestStore | None = HarvestStore(Path(cfg.eval_store))
        except StoreError as err:
            raise TrainError(f"train.eval_store: {err}") from None
        if not len(eval_store):
            raise TrainError(f"train.eval_store={cfg.eval_store}: holds no sample; nothing to evaluate on")
        eval_store.check_target(target)
        if eval_store.spec.aux_layer_ids != spec.aux_layer_ids:
            raise TrainError(f"train.eval_store={cfg.eval_store}: aux_layer_ids {list(eval_store.spec.aux_layer_ids)}"
                             f" differ from the training store's {list(spec.aux_layer_ids)}")
        seen = set(store.token_digests())
        shared = [d in seen for d in eval_store.token_digests()]  # the same conversation (tokens) in both
        if all(shared):
            raise TrainError(f"train.eval_store={cfg.eval_store}: every one of its {len(eval_store)} samples is also "
                             "a training sample (same tokens): its figures and the best/ draft would be measured on "
                             "training data; evaluate on a store of other conversations")
        train_idx, eval_idx = list(range(len(store))), [i for i, dup in enumerate(shared) if not dup]
        if len(eval_idx) < len(eval_store):
            print0(f"train.eval_store: {len(eval_store) - len(eval_idx)} of its {len(eval_store)} samples are also "
                   f"training samples (same tokens); evaluating on the other {len(eval_idx)}")
    else:
        train_idx, eval_idx = split_by_id(store.sample_ids, cfg.eval_fraction)
        eval_store = store if eval_idx else None
    if not train_idx or (cfg.eval_fraction > 0 and not eval_idx):
        raise TrainError(f"train.eval_fraction={cfg.eval_fraction} leaves {len(train_idx)} training and "
                         f"{len(eval_idx)} eval samples of {len(store)} in {cfg.store}")

    verify_stores([cfg.store, *cfg.extra_stores, *([cfg.eval_store] if cfg.eval_store else [])],
                  out_dir / VERIFIED, rt)
    embedding = target.embed_tokens.weight.detach().float().cpu()
    initial = _initial_draft(cfg.init_draft, spec, target, embedding) if cfg.init_draft else None

    # -- draft vocab: chosen once, frozen for the run
    resume_tag = latest_tag(ckpt_root) if cfg.resume and ckpt_root.is_dir() else None
    pinned = pinned_settings(cfg, rt.world_size, store, eval_store)
    if resume_tag is not None:
        check_pinned(read_trainer_state(ckpt_root, resume_tag).get("pinned", {}), pinned, out_dir)
    vocab_file = out_dir / "draft_vocab.safetensors"
    if resume_tag is not None:
        vocab = read_draft_vocab(vocab_file, target.vocab_size)
    else:
        eos = target.tokenizer.eos_token_id
        vocab = choose_draft_vocab(cfg, store, train_idx, target.vocab_size, [] if eos is None else [eos], initial)
        if rt.rank == 0:
            out_dir.mkdir(parents=True, exist_ok=True)
            write_draft_vocab(vocab_file, vocab)
    _barrier()

    # -- the draft (same seed on every rank), the target's head, the engine
    seed_everything(cfg.seed)
    if initial is not None:
        draft, draft_config = initial, initial.config
    else:
        try:
            draft_config = DraftConfig.from_target_config(target.config, draft_vocab_size=vocab.size,
                                                          num_aux_layers=len(spec.aux_layer_ids),
                                                          **cfg.draft_overrides())
        except ValueError as err:
            raise TrainError(f"draft shape: {err}") from None
        draft = Eagle3Draft(draft_config, embedding)
    draft.set_draft_vocab(vocab.d2t, vocab.t2d)
    if cfg.lm_head_init == "target" and not cfg.init_draft:
        # the target's logit scale folded into the rows (a soft cap has no linear equivalent)
        rows = target.lm_head.weight.detach().float().cpu() * target.logit_transform.scale
        norm_scale = target.final_norm_scale()
        if norm_scale is None:
            print0("train.lm_head_init=target: the target's final norm is not an RMSNorm; the draft's final norm "
                   "starts at one")
        draft.init_lm_head_from_target(rows, vocab.d2t, norm_scale)
    if cfg.layer_init == "readout" and not cfg.init_draft:
        try:
            draft.init_as_readout()
        except ValueError as err:
            raise TrainError(f"train.layer_init=readout: {err}") from None
    if cfg.freeze_lm_head:
        draft.lm_head.weight.requires_grad_(False)
    if cfg.precision == "bf16" and rt.device.type == "cpu" and (speedup := bf16_matmul_speedup("cpu")) < 1.0:
        print0(f"train.precision=bf16: this CPU runs bf16 matmuls {1 / speedup:.0f}x slower than fp32 (no bf16 "
               f"units, measured); train.precision=fp32 will be much faster here")
    head = TargetHead.of_target(target, cfg.target_temperature).to(rt.device)
    t2d = vocab.t2d.to(rt.device)
    target_name = spec.target
    del target  # only the head is needed from here on
    model = TTTModel(draft, cfg.ttt_steps, cfg.step_decay, cfg.gradient_checkpointing, cfg.loss_on_oov,
                     cfg.feature_noise, cfg.gate_steps).to(rt.device)
    schedule = warmup_decay(cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio, cfg.lr_schedule)
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.optimizer == "muon":  # DeepSpeed builds Muon + its auxiliary AdamW from the config
        muon_ns_in_fp32_where_bf16_is_slow(rt.device)
        groups = muon_param_groups(model, cfg.lr, muon_ns_method(cfg.muon_ns_method, rt.device))
        engine, optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=groups,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule),
            config=deepspeed_config(cfg, rt.world_size))
    else:
        optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                      eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                               config=deepspeed_config(cfg, rt.world_size))
    dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float32
    weights = step_weights(cfg.ttt_steps, cfg.step_decay)

    # -- resume
    state: dict[str, Any] = {"step": 0, "epoch": 0, "batch_index": 0, "best_tau": None, "best_step": None,
                             "first_eval": None, "last_eval": None, "first_loss": None, "pinned": pinned}
    if rt.rank == 0:  # what a kill left half-written
        remove_leftovers(out_dir, ["best", "final", "summary.json", "metrics.jsonl", "wandb_run_id",
                                   vocab_file.name, VERIFIED])
    if rt.rank == 0 and resume_tag is None:  # starting over: no stale checkpoint or export survives
        for old in (ckpt_root, out_dir / "best", out_dir / "final"):
            shutil.rmtree(old, ignore_errors=True)
    elif rt.rank == 0:
        remove_partial(ckpt_root)
    _barrier()
    if resume_tag is not None:
        client = load_checkpoint(engine, ckpt_root, resume_tag, rank=rt.rank, world_size=rt.world_size)
        state.update(client["trainer"])
        print0(f"train: resumed from {ckpt_root / resume_tag} (step {state['step']})")
    # after any resume: DeepSpeed restores the clip a checkpoint saved
    if cfg.optimizer == "muon" and unclip_muon_updates_under_zero(engine) and cfg.max_grad_norm:
        print0(f"train.max_grad_norm={cfg.max_grad_norm} is not applied: DeepSpeed's ZeRO optimizer would clip "
               "Muon's orthogonalised updates instead of the gradients (train.zero_stage=0, or bf16 at stage 1, "
               "clips the gradients)")
    resumed_step = state["step"] if resume_tag is not None else None
    if resumed_step is not None and resumed_step >= cfg.steps:  # finished earlier: its record stands
        done = out_dir / "summary.json"
        seen = torch.tensor([float(rt.rank == 0 and done.is_file() and (out_dir / "final").is_dir())],
                            device=rt.device)
        if _all_reduce_sum(seen).item():  # rank 0's view decides for every rank
            print0(f"train: finished earlier in {out_dir} (step {resumed_step}); nothing to do")
            if rt.rank == 0:
                return json.loads(done.read_text())
            return {"stage": "train", "out": str(out_dir), "steps": resumed_step}

    sink = (RunSink(out_dir, wandb_mode=cfg.wandb_mode, project=cfg.wandb_project, run_name=cfg.wandb_run_name,
                    config={"train": asdict(cfg), "target": asdict(target_cfg), "draft": asdict(draft_config)},
                    resume_step=resumed_step)
            if rt.rank == 0 else NullSink())
    info = {"target": target_name, "aux_layer_ids": list(spec.aux_layer_ids),
            "tokenizer_sha256": spec.tokenizer_sha256}

    def evaluate() -> dict[str, float]:
        assert eval_store is not None
        tally = AcceptanceTally(cfg.ttt_steps, rt.device)
        engine.eval()
        with torch.no_grad():
            for idx in eval_batches_for_rank(eval_plan, rt.rank, rt.world_size):
                out = _run(engine, head, load_batch(eval_store, idx or eval_plan[0], cfg.batching), t2d, dtype,
                           rt.device)
                if idx is not None:  # a pad forward keeps ZeRO-3's collectives in step; not counted
                    tally.add(out)
        engine.train()
        return tally.all_reduce().summary(weights, "eval")

    def save() -> None:
        client = {"trainer": dict(state), "draft_config": asdict(draft_config)}
        save_checkpoint(engine, ckpt_root, state["step"], client, rank=rt.rank, keep=cfg.keep_checkpoints,
                        readable=client["trainer"])

    def maybe_eval() -> dict[str, float] | None:
        if eval_store is None:
            return None
        metrics = evaluate()
        sink.log(metrics, state["step"])
        if state["first_eval"] is None:
            state["first_eval"] = {k: v for k, v in metrics.items() if k in ("eval/loss", "eval/tau_sim")}
        state["last_eval"] = metrics
        tau = metrics["eval/tau_sim"]
        better = state["best_tau"] is None or tau > state["best_tau"]
        if better and state["step"] > 0:
            state["best_tau"], state["best_step"] = tau, state["step"]
            weights_now = _draft_state(draft, cfg.zero_stage)
            _stop_if_not_finite(weights_now, state["step"])  # on every rank: they hold the same weights
            if rt.rank == 0:
                export_draft(out_dir / "best", weights_now, draft_config,
                             {**info, "step": state["step"], "eval": metrics})
        return metrics

    lengths = store.lengths
    sample_ids = store.sample_ids
    eval_plan = (epoch_batches((eval_store.lengths), eval_idx, cfg.batching, cfg.micro_batch_tokens, cfg.seed, 0)
                 if eval_store is not None else [])
    per_step = rt.world_size * cfg.gradient_accumulation
    plan_epoch, plan = -1, []
    if state["step"] == 0 and cfg.eval_at_start:
        maybe_eval()
    bar = tqdm(total=cfg.steps, initial=state["step"], desc="train", unit="step", dynamic_ncols=True,
               disable=not (cfg.progress and rt.rank == 0), file=sys.stderr)
    tokens_total, train_seconds, last_loss = 0, 0.0, None
    window = {"tokens": 0, "seconds": 0.0}
    with bar:
        while state["step"] < cfg.steps:
            if plan_epoch != state["epoch"]:
                epoch_idx = (weighted_indices(train_idx, sample_ids, weights_by_id, cfg.seed, state["epoch"])
                             if weights_by_id else train_idx)
                plan = epoch_batches(lengths, epoch_idx, cfg.batching, cfg.micro_batch_tokens, cfg.seed,
                                     state["epoch"])
                plan_epoch = state["epoch"]
                if steps_per_epoch(len(plan), rt.world_size, cfg.gradient_accumulation) == 0:
                    raise TrainError(f"{cfg.store}: {len(plan)} micro-batches of train.micro_batch_tokens="
                                     f"{cfg.micro_batch_tokens} per epoch, fewer than world_size x "
                                     f"gradient_accumulation = {per_step}")
            step_in_epoch = state["batch_index"] // per_step
            if step_in_epoch >= steps_per_epoch(len(plan), rt.world_size, cfg.gradient_accumulation):
                state["epoch"], state["batch_index"] = state["epoch"] + 1, 0
                continue
            t0 = time.perf_counter()
            lr = cfg.lr * schedule(state["step"])  # the AdamW lr; Muon matrices follow the same factor
            tally = AcceptanceTally(cfg.ttt_steps, rt.device)
            sums = torch.zeros(2, dtype=torch.float64, device=rt.device)  # loss over micro-batches, tokens
            grad_norm = None
            for micro in range(cfg.gradient_accumulation):
                idx = plan[rank_batch_index(step_in_epoch, micro, rt.rank, rt.world_size, cfg.gradient_accumulation)]
                out, sums_now = train_forward(engine, head, load_batch(store, idx, cfg.batching), t2d, dtype,
                                              rt.device, cfg.loss_positions)
                engine.backward(out.loss)
                if micro == cfg.gradient_accumulation - 1 and cfg.zero_stage == 0 and dtype == torch.float32:
                    grad_norm = _grad_norm(engine, params)
                engine.step()
                tally.add(out)
                sums += sums_now
            _all_reduce_sum(sums)
            metrics = tally.all_reduce().summary(weights, "train")
            seconds = time.perf_counter() - t0
            state["step"] += 1
            state["batch_index"] += per_step
            loss = float(sums[0]) / per_step
            if not math.isfinite(loss):  # every rank sees the same reduced loss
                raise TrainError(f"step {state['step']}: the loss is {loss}; stopping before a non-finite draft is "
                                 "saved or exported (check the store's states, train.init_draft and train.lr)")
            grad_norm = grad_norm if grad_norm is not None else _grad_norm(engine, params)
            if state["step"] == 1:  # the run's first step, whichever process ran it (kept in checkpoints)
                state["first_loss"] = loss
            last_loss = loss
            tokens_total += int(sums[1])
            train_seconds += seconds
            window["tokens"] += int(sums[1])
            window["seconds"] += seconds
            metrics |= {"train/loss": loss, "train/lr": lr, "train/tokens": int(sums[1]), "train/epoch": state["epoch"]}
            if grad_norm is not None:
                metrics["train/grad_norm"] = grad_norm
            if state["step"] % cfg.log_every == 0 or state["step"] == cfg.steps:
                metrics["train/tokens_per_s"] = window["tokens"] / max(window["seconds"], 1e-9)
                window = {"tokens": 0, "seconds": 0.0}
                sink.log(metrics, state["step"])
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", tau=f"{metrics['train/tau_sim']:.2f}",
                            tok_s=f"{int(sums[1]) / seconds:.0f}")
            at_end = state["step"] == cfg.steps
            if eval_store is not None and ((cfg.eval_every and state["step"] % cfg.eval_every == 0) or at_end):
                maybe_eval()
            if (cfg.save_every and state["step"] % cfg.save_every == 0) or at_end:
                save()
    final_state = _draft_state(draft, cfg.zero_stage)
    _stop_if_not_finite(final_state, state["step"])
    if rt.rank == 0:
        export_draft(out_dir / "final", final_state, draft_config,
                     {**info, "step": state["step"], "eval": state["last_eval"] or {}})
    sink.close()
    summary = {
        "stage": "train", "out": str(out_dir), "steps": state["step"], "resumed_from_step": resumed_step,
        "world_size": rt.world_size, "zero_stage": cfg.zero_stage, "precision": cfg.precision,
        "device": str(rt.device), "train_samples": len(train_idx), "eval_samples": len(eval_idx),
        "draft_vocab_size": vocab.size, "trainable_parameters": trainable_parameter_count(draft_config)
        - (draft_config.draft_vocab_size * draft_config.hidden_size if cfg.freeze_lm_head else 0),
        "first_loss": state["first_loss"], "last_loss": last_loss,
        "tokens_per_s": round(tokens_total / train_seconds, 1) if train_seconds else None,
        "eval_first": state["first_eval"], "eval_last": ({k: v for k, v in state["last_eval"].items()
                                                          if k in ("eval/loss", "eval/tau_sim")}
                                                         if state["last_eval"] else None),
        "best_step": state["best_step"], "best_tau_sim": state["best_tau"],
        "wall_seconds": round(time.perf_counter() - started, 2),
    }
    if rt.rank == 0:
        from eagle3.atomic import atomic_write_text

        atomic_write_text(out_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    return summary


# ---------------------------------------------------------------- CLI


def _field_type(hint: Any) -> tuple[type, bool]:
    """(scalar type, optional) of a TrainConfig field annotation."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0], True
    return hint, False


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eagle3.train", description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=TargetConfig.name_or_path, help="target name or path (default %(default)s)")
    parser.add_argument("--target-dtype", default="auto", help="dtype the target's head runs in")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    hints = typing.get_type_hints(TrainConfig)
    defaults = TrainConfig()
    for f in fields(TrainConfig):
        flags = ["--" + f.name.replace("_", "-")] + (["--out"] if f.name == "out_dir" else [])
        kind, optional = _field_type(hints[f.name])
        default = getattr(defaults, f.name)
        if kind is bool:
            parser.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction, default=default)
        elif typing.get_origin(kind) is list:
            parser.add_argument(*flags, dest=f.name, nargs="*", type=typing.get_args(kind)[0], default=default,
                                help=f"default {default!r}; space-separated")
        else:
            parser.add_argument(*flags, dest=f.name, type=kind, default=default,
                                required=f.name in ("store", "out_dir"),
                                help=f"default {default!r}" + (" (None: unset)" if optional else ""))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    target_cfg_args = {"name_or_path": args.pop("target"), "dtype": args.pop("target_dtype")}
    args.pop("local_rank")
    try:
        cfg = TrainConfig(**args)
        target_cfg = TargetConfig(**target_cfg_args)
    except ValueError as err:
        parser.error(str(err))
    try:
        summary = train(cfg, target_cfg)
    except USER_ERRORS as err:
        print(f"train: error: {err}", file=sys.stderr)
        return 2
    print0(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
