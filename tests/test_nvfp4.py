"""NVFP4: the arithmetic against compressed-tensors' reference, conversion, emulated loading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from data_gen import nvfp4 as conversion
from eagle3.target import nvfp4
from eagle3.target.model import load_target
from tests.helpers import TINY_VOCAB, tiny_llama, tiny_tokenizer

ct = pytest.importorskip("compressed_tensors")


def ct_nvfp4_args():
    from compressed_tensors.quantization.quant_scheme import NVFP4

    return NVFP4["weights"], NVFP4["input_activations"]


# --------------------------------------------------------------------------- arithmetic


def test_rounding_by_hand_and_against_compressed_tensors() -> None:
    from compressed_tensors.quantization.utils.fp4_utils import cast_to_fp4

    x = torch.tensor([0.0, 0.2, 0.25, 0.26, 0.75, 1.25, 1.3, 1.75, 2.5, 2.6, 3.5, 4.9, 5.0, 5.1, 7.0,
                      -0.75, -5.0, -9.0])
    want = torch.tensor([0, 0, 0, 0.5, 1, 1, 1.5, 2, 2, 3, 4, 4, 4, 6, 6, -1, -4, -6])
    assert torch.equal(nvfp4.round_to_e2m1(x), want)
    grid = torch.arange(-800, 801) / 100.0  # every tie and both sides of each
    assert torch.equal(nvfp4.round_to_e2m1(grid), cast_to_fp4(grid.clone()))


def test_pack_unpack_exact_and_same_bytes_as_compressed_tensors() -> None:
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8

    values = torch.tensor(nvfp4.E2M1_VALUES)
    every = torch.cat([values, -values[1:]])  # the 15 distinct values
    codes = every[torch.randint(0, len(every), (37, 64), generator=torch.Generator().manual_seed(0))]
    packed = nvfp4.pack_fp4(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (37, 32)
    assert torch.equal(nvfp4.unpack_fp4(packed), codes)
    assert torch.equal(packed, pack_fp4_to_uint8(codes))
    assert torch.equal(unpack_fp4_from_uint8(packed, 37, 64), codes)
    # by hand: 1.5 (index 3) in the low nibble, -6 (sign 8 | index 7) in the high one
    assert nvfp4.pack_fp4(torch.tensor([[1.5, -6.0]])).item() == 3 | (15 << 4)
    assert torch.equal(nvfp4.unpack_fp4(torch.arange(256, dtype=torch.uint8)).view(256, 2)[0x5F],
                       torch.tensor([-6.0, 3.0]))
    with pytest.raises(ValueError, match="even"):
        nvfp4.pack_fp4(torch.zeros(3))


def test_scales_codes_and_fake_quant_equal_compressed_tensors() -> None:
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize, quantize
    from compressed_tensors.quantization.utils.helpers import (
        calculate_qparams,
        compute_dynamic_scales_and_zp,
        generate_gparam,
    )

    w_args, a_args = ct_nvfp4_args()
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 128, generator=gen) * torch.rand(96, 1, generator=gen) * 0.1
    w[3, :16] = 0  # an all-zero block: its scale is FP8's epsilon, not 0
    g = nvfp4.global_scale(w.abs().amax())
    assert torch.equal(g, generate_gparam(w.min(), w.max()))
    blocks = w.unflatten(-1, (-1, 16))
    ref_scale, zero = calculate_qparams(blocks.amin(-1), blocks.amax(-1), w_args, global_scale=g)
    codes, scale = nvfp4.quantize(w, g)
    assert scale.dtype == torch.float8_e4m3fn and scale[3, 0].float().item() == nvfp4.FP8_EPS
    assert torch.equal(scale.float(), ref_scale)
    assert torch.equal(codes, quantize(w, ref_scale, zero, w_args, global_scale=g))
    assert torch.equal(nvfp4.dequantize(codes, scale, g), fake_quantize(w, ref_scale, zero, w_args, global_scale=g))

    x = torch.randn(3, 7, 128, generator=gen) * 5  # activations: scales per block from x itself
    gx = nvfp4.global_scale(30.0)
    s, z = compute_dynamic_scales_and_zp(x, a_args, torch.nn.Linear(1, 1), global_scale=gx)
    assert torch.equal(nvfp4.fake_quantize(x, gx), fake_quantize(x, s, z, a_args, global_scale=gx))


def test_quantization_error_within_the_format_bounds() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.cat([torch.randn(64, 256, generator=gen), torch.randn(64, 256, generator=gen).pow(3) * 10])
    g = nvfp4.global_scale(x.abs().amax())
    codes, scale = nvfp4.quantize(x, g)
    err = (nvfp4.dequantize(codes, scale, g) - x).abs()
    bound = nvfp4.quantization_error_bound(x, g)
    assert bool((err <= bound * (1 + 1e-6)).all())
    assert (err / bound.clamp(min=1e-30)).max() > 0.9  # the bound is tight, not vacuous
    # each block's largest |value| lands on (or next to) the grid's top: the scales use FP8's range
    step = (scale.float() / g).unsqueeze(-1)
    top = (x.unflatten(-1, (-1, 16)).abs().amax(-1, keepdim=True) / step)
    assert float(top.min()) > 5.0 and float(top.max()) < 7.0
    # relative error of Gaussian weights: FP4's ~4 levels per octave give roughly 10%
    w = torch.randn(256, 256, generator=gen)
    wq = nvfp4.dequantize(*nvfp4.quantize(w, nvfp4.global_scale(w.abs().amax())), nvfp4.global_scale(w.abs().amax()))
    assert 0.05 < ((wq - w).norm() / w.norm()).item() < 0.15


# --------------------------------------------------------------------------- conversion and emulation


def calib_ids(n: int = 4, length: int = 40) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(6, TINY_VOCAB, (length,), generator=gen).tolist() for _ in range(n)]


def ct_reference_model(source: Path, checkpoint: Path):
    """compressed-tensors' own fake-quant forward on the dense source, scales from our checkpoint."""
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    qcfg = json.loads((checkpoint / "config.json").read_text())["quantization_config"]
    apply_quantization_config(ref, QuantizationConfig.model_validate({**qcfg, "quantization_status": "frozen"}))
    tensors = load_file(checkpoint / "model.safetensors")
    with torch.no_grad():
        for name, module in ref.named_modules():
            if getattr(module, "quantization_scheme", None) is None:
                continue
            for leaf in ("weight_scale", "weight_global_scale", "input_global_scale"):
                if hasattr(module, leaf):
                    getattr(module, leaf).data.copy_(tensors[f"{name}.{leaf}"].float())
    return ref


def test_w4a4_emulation_equals_compressed_tensors_fake_quant(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "nvfp4"
    report = conversion.convert(str(tiny_model_dir), out, calibration=calib_ids())
    assert report["quantized_linears"] == 8 * 7 and report["calibration_tokens"] == 160
    assert set(report["unquantized_matrices"]) == {"model.embed_tokens.weight", "lm_head.weight"}
    emulated = nvfp4.load_emulated(out)
    assert emulated.nvfp4_mode == "w4a4"
    ref = ct_reference_model(tiny_model_dir, out)
    ids = torch.randint(6, TINY_VOCAB, (2, 30), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours, theirs = emulated(ids).logits, ref(ids).logits
        dense = tiny_llama(vocab=TINY_VOCAB)(ids).logits
    assert torch.equal(ours, theirs)
    assert (ours - dense).abs().max() > 1e-3  # quantisation did change something
    # W4A16 of the same checkpoint: weights only, so closer to the dense model than W4A4
    w4a16 = nvfp4.load_emulated(out, mode="w4a16")
    with torch.no_grad():
        weight_only = w4a16(ids).logits
    assert 0 < (weight_only - dense).abs().mean() < (ours - dense).abs().mean()


def test_checkpoint_layout_is_what_vllm_reads(tiny_model_dir: Path, tmp_path: Path) -> None:
    from compressed_tensors.quantization import QuantizationConfig

    out = tmp_path / "nvfp4"
    conversion.convert(str(tiny_model_dir), out, calibration=calib_ids())
    config = json.loads((out / "config.json").read_text())
    qcfg = config["quantization_config"]
    assert qcfg["quant_method"] == "compressed-tensors" and qcfg["format"] == "nvfp4-pack-quantized"
    assert qcfg["ignore"] == ["lm_head"]
    parsed = QuantizationConfig.model_validate(qcfg)  # compressed-tensors' schema accepts it
    scheme = parsed.config_groups["group_0"]
    assert scheme.weights.group_size == 16 and scheme.input_activations.dynamic == "local"
    t = load_file(out / "model.safetensors")
    q = "model.layers.0.self_attn.q_proj"
    assert t[f"{q}.weight_packed"].dtype == torch.uint8 and t[f"{q}.weight_packed"].shape == (64, 32)
    assert t[f"{q}.weight_scale"].dtype == torch.float8_e4m3fn and t[f"{q}.weight_scale"].shape == (64, 4)
    assert t[f"{q}.weight_global_scale"].shape == (1,) and t[f"{q}.input_global_scale"].dtype == torch.float32
    assert f"{q}.weight" not in t and "lm_head.weight" in t and "model.norm.weight" in t
    # fused siblings (q/k/v, gate/up) share one weight global scale, as vLLM keeps one per fused layer
    layer = "model.layers.0"
    assert len({t[f"{layer}.self_attn.{p}_proj.weight_global_scale"].item() for p in "qkv"}) == 1
    assert len({t[f"{layer}.mlp.{p}_proj.weight_global_scale"].item() for p in ("gate", "up")}) == 1
    assert t[f"{layer}.self_attn.o_proj.weight_global_scale"] != t[f"{layer}.self_attn.q_proj.weight_global_scale"]
    # the input scale maps the calibrated |x| max onto FP8 * FP4 max
    report = json.loads((out / conversion.REPORT_FILE).read_text())
    amax = report["per_linear"][q]["input_amax"]
    assert t[f"{q}.input_global_scale"].item() == pytest.approx(448 * 6 / amax, rel=1e-6)


def test_calibration_records_the_largest_input(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    linears = conversion.quantizable_linears(model)
    assert "lm_head" not in linears and len(linears) == 56
    seen: dict[str, float] = {}
    down = "model.layers.3.mlp.down_proj"
    handle = linears[down].register_forward_pre_hook(
        lambda m, a: seen.__setitem__("x", max(seen.get("x", 0.0), a[0].abs().max().item())))
    calib = conversion.calibrate(model, linears, (torch.tensor([s]) for s in calib_ids(3)))
    handle.remove()
    assert calib.input_amax[down] == seen["x"]
    assert ["model.layers.3.mlp.gate_proj", "model.layers.3.mlp.up_proj"] in calib.fused
    assert not any(down in g for g in calib.fused)
    with pytest.raises(nvfp4.NVFP4Error, match="no tokens"):
        conversion.calibrate(model, linears, iter(()))


def test_int4_compressed_tensors_source_converts(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Kimi K2.x ships INT4 pack-quantized (group 32): dequantised on load, then NVFP4."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    model = tiny_llama(vocab=TINY_VOCAB)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)}, ignore=["lm_head"]))
    int4_weights = {}
    for name, module in model.named_modules():
        if getattr(module, "quantization_scheme", None) is None:
            continue
        groups = module.weight.data.unflatten(-1, (-1, 32))
        scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
        module.weight_scale.data.copy_(scale)
        module.weight_zero_point.data.copy_(zero)
        q = (groups / scale.unsqueeze(-1)).round().clamp(-8, 7)
        int4_weights[name] = (q * scale.unsqueeze(-1)).flatten(-2)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    int4 = tmp_path / "int4"
    model.save_pretrained(int4)
    tiny_tokenizer().save_pretrained(int4)
    compressor.update_config(int4)
    assert json.loads((int4 / "config.json").read_text())["quantization_config"]["format"] == "pack-quantized"

    out = tmp_path / "nvfp4"
    conversion.convert(str(int4), out, mode="w4a16")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["format"] == "nvfp4-pack-quantized"
    assert config["quantization_config"]["config_groups"]["group_0"]["input_activations"] is None
    t = load_file(out / "model.safetensors")
    name = "model.layers.2.mlp.down_proj"
    # the NVFP4 weight is the NVFP4 quantisation of the dequantised INT4 weight
    gscale = t[f"{name}.weight_global_scale"]
    codes, scale = nvfp4.quantize(int4_weights[name], gscale)
    assert torch.equal(nvfp4.pack_fp4(codes), t[f"{name}.weight_packed"])
    assert torch.equal(scale.float(), t[f"{name}.weight_scale"].float())
    with pytest.raises(nvfp4.NVFP4Error, match="already NVFP4"):
        conversion.convert(str(out), tmp_path / "again", mode="w4a16")


def test_load_target_runs_the_checkpoint_emulated(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "nvfp4"
    conversion.convert(str(tiny_model_dir), out, calibration=calib_ids())
    target = load_target(str(out), dtype="float32", device="cpu", aux_layer_ids=[1, 4, 6])
    assert target.model.nvfp4_mode == "w4a4" and target.model.name_or_path == str(out)
    ids = torch.randint(6, TINY_VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    captured = target(ids)
    assert captured.aux.shape == (1, 12, 3, 64)
    assert torch.equal(captured.logits, nvfp4.load_emulated(out)(ids).logits)
    assert torch.allclose(target.head(captured.last), captured.logits, atol=1e-5)
    weight_only = load_target(str(out), dtype="float32", device="cpu", nvfp4_mode="w4a16")
    assert weight_only.model.nvfp4_mode == "w4a16"
    a16 = tmp_path / "a16"
    conversion.convert(str(tiny_model_dir), a16, mode="w4a16")
    with pytest.raises(Exception, match="no input_global_scale"):
        load_target(str(a16), dtype="float32", device="cpu", nvfp4_mode="w4a4")


def test_bad_requests_are_refused(tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(nvfp4.NVFP4Error, match="calibration"):
        conversion.convert(str(tiny_model_dir), tmp_path / "x", mode="w4a4")
    with pytest.raises(nvfp4.NVFP4Error, match="mode"):
        conversion.convert(str(tiny_model_dir), tmp_path / "x", mode="w8a8")
    assert not (tmp_path / "x").exists()
    with pytest.raises(nvfp4.NVFP4Error, match="no nvfp4-pack-quantized"):
        nvfp4.load_emulated(tiny_model_dir)
    from transformers import LlamaConfig, LlamaForCausalLM

    odd = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=40, intermediate_size=80, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(nvfp4.NVFP4Error, match="multiple of 16"):
        conversion.quantizable_linears(odd)
    with pytest.raises(nvfp4.NVFP4Error, match=r"ignore \['lm_haed'\]: matches no Linear"):
        conversion.quantizable_linears(odd, ignore=("lm_haed",))
    assert conversion.main(["--target", str(tiny_model_dir), "--out", str(tmp_path / "y"), "--samples", "-3"]) == 2
    assert "quantize.samples=-3: must be >= 1" in capsys.readouterr().err
    assert not (tmp_path / "y").exists()


def test_quality_report_figures(tiny_model_dir: Path, tmp_path: Path) -> None:
    from serve_eval.quant_report import compare_on, run

    out = tmp_path / "nvfp4"
    conversion.convert(str(tiny_model_dir), out, calibration=calib_ids())
    reference = load_target(str(tiny_model_dir), dtype="float32", device="cpu")
    quantized = load_target(str(out), dtype="float32", device="cpu")
    gen = torch.Generator().manual_seed(5)
    prompts = {"a": [torch.randint(6, TINY_VOCAB, (9,), generator=gen).tolist() for _ in range(3)]}
    same = run(reference, reference, prompts, max_new_tokens=8, stop_ids=[2])
    assert same["a"]["top1_agreement"] == 1.0 and same["a"]["kl"] == 0.0
    assert same["a"]["greedy_equal"] == 3 and same["a"]["ppl_reference"] == same["a"]["ppl_quantized"]
    report = run(reference, quantized, prompts, max_new_tokens=8, stop_ids=[2])
    assert report["a"]["kl"] > 0 and report["a"]["ppl_reference"] != report["a"]["ppl_quantized"]
    assert report["overall"]["prompts"] == 3 and report["a"]["tokens"] == 3 * report["a"]["greedy_tokens"]
    # teacher-forced figures by hand for one prompt: KL and NLL from the two models' own logits
    prompt, continuation = prompts["a"][0], [7, 8, 9]
    cmp = compare_on(reference, quantized, prompt, continuation)
    ids = torch.tensor([prompt + continuation])
    p = reference(ids).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
    q = quantized(ids).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
    start = int(cmp["start"])
    assert torch.allclose(cmp["kl"][start:], (p.exp() * (p - q)).sum(-1), atol=1e-5)
    assert torch.allclose(cmp["nll_q"][start:], -q[torch.arange(3), torch.tensor(continuation)], atol=1e-5)


def test_pipeline_quantize_stage_runs_later_stages_on_the_nvfp4_target(tiny_model_dir: Path, tmp_path: Path) -> None:
    from data_gen.config import QuantizeConfig
    from eagle3.config import TargetConfig
    from recipes.config import PipelineConfig
    from recipes.pipeline import run_pipeline

    calib = tmp_path / "calib.jsonl"
    calib.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"question {i}?"},
                                                      {"role": "assistant", "content": f"answer {i}."}]}) + "\n"
                             for i in range(3)))
    cfg = PipelineConfig(target=TargetConfig(name_or_path=str(tiny_model_dir), dtype="float32", device="cpu"),
                         quantize=QuantizeConfig(calibration=str(calib), samples=2), out_dir=str(tmp_path / "run"),
                         stages=["quantize", "target"])
    results = run_pipeline(cfg)
    out = tmp_path / "run" / "nvfp4-target"
    assert results["quantize"]["out_dir"] == str(out) and results["quantize"]["calibration_tokens"] > 0
    assert results["target"]["target"] == str(out)  # the target stage loaded the NVFP4 checkpoint
    assert max(results["target"]["capture_max_rel_error_vs_hf"].values()) < 1e-5
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    run_pipeline(cfg)  # same settings: reused, not rewritten
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    with pytest.raises(ValueError, match="put it after pools"):
        run_pipeline(PipelineConfig(stages=["quantize", "pools"], out_dir=str(tmp_path / "x")))


def test_vllm_preparation_leaves_other_checkpoints_alone(tiny_model_dir: Path) -> None:
    """Only an NVFP4 checkpoint on a machine without CUDA changes vLLM's kernel list."""
    assert conversion.prepare_vllm_on_cpu(tiny_model_dir) is False
    assert nvfp4.nvfp4_quantization(tiny_model_dir) is None
