"""A card stated inline (issue 52, item 2): a profile's `hardware:` may be the card's datasheet figures instead
of a row of the tables. The same figures as a row simulate exactly as that row does; the card launches on the
simulator; a card that does not read is one error line naming the file and the key; and what the simulator
says of an unfitted card never claims the seeds' fit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from campaign.cli import run_cli
from campaign.core.hardware import HARDWARE, hardware_label, resolve_hardware
from campaign.plan import replay
from campaign.server.profiles import load_profile
from campaign.sim import config as sim_config
from campaign.sim import model as sim_model
from campaign.tune import tuning

ROOT = Path(__file__).resolve().parents[1]
RTX_4090 = {"name": "my-4090", "memory_gb": 24, "bandwidth_gb_s": 1008, "bf16_tflops": 165.2, "fp8_tflops": 330.3,
            "int8_tops": 660.6, "reported_gib": 23.99, "generation": "ada"}


def profile_with(tmp_path: Path, hardware: object, name: str = "card.yaml") -> Path:
    """A profile serving Llama 3.1 8B (its shape from the shipped config) on `hardware`."""
    raw = {"schema_version": 1, "description": "a card stated inline", "engine": "sim",
           "model": "meta-llama/Llama-3.1-8B", "hardware": hardware,
           "flags": {"max-model-len": 8192, "gpu-memory-utilization": 0.9}}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw))
    return path


def test_a_card_inline_with_a_rows_figures_simulates_as_that_row(tmp_path: Path) -> None:
    """The RTX 4090's datasheet figures given inline: the same memory, KV cache and step costs as the row (neither
    is fitted to a measurement); its name reads as stated, and `count` gives the cards for TP."""
    inline = replay.profile_config(str(profile_with(tmp_path, RTX_4090)))
    named = replay.profile_config(str(profile_with(tmp_path, "rtx-4090", "named.yaml")))
    assert inline.memory() == named.memory()
    assert inline.costs == named.costs
    assert not sim_model.fitted(inline.hardware, inline.model_shape)
    assert hardware_label(inline.hardware) == "my-4090 (a card stated inline)"
    card, count = resolve_hardware(inline.hardware) or (None, 0)
    assert card is not None and (card.memory_gb, card.bf16_tflops, count) == (24, 165.2, 1)
    assert card.name == "inline:my-4090" and card.name not in HARDWARE   # never a row's fitted calibration
    pair = resolve_hardware(json.dumps({**RTX_4090, "count": 2}))
    assert pair is not None and pair[1] == 2


def test_a_profile_stating_its_card_inline_launches(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`campaign launch PROFILE --engine sim --once` starts the simulator on the card the profile states."""
    path = profile_with(tmp_path, RTX_4090)
    assert load_profile(str(path))[0].simulatable
    code = run_cli(["launch", str(path), "--engine", "sim", "--once"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "memory for KV cache" in out + err and "stopped:" in out + err, (out, err)


@pytest.mark.parametrize(("card", "says"), [
    ({"memory_gb": 24, "bandwidth": 1008, "bf16_tflops": 165.2},
     "hardware: unknown key(s) bandwidth: a card inline takes memory_gb, bandwidth_gb_s, bf16_tflops"),
    ({"memory_gb": 24, "bf16_tflops": 165.2}, "hardware: a card inline needs bandwidth_gb_s"),
    ({"memory_gb": None, "bandwidth_gb_s": 1008, "bf16_tflops": 165.2}, "hardware: a card inline needs memory_gb"),
    ({"memory_gb": 24, "bandwidth_gb_s": -1, "bf16_tflops": 165.2},
     "hardware: bandwidth_gb_s: a number above 0 is expected, got -1"),
    ({**RTX_4090, "count": 0}, "hardware: count: a whole number of cards, at least 1, is expected, got 0"),
    ({**RTX_4090, "link_gb_s": 0}, "hardware: link_gb_s: a number above 0 is expected, got 0"),
    ({**RTX_4090, "generation": "lovelace"},
     "hardware: generation: one of ampere, ada, hopper, blackwell, cdna3 is expected, got 'lovelace'"),
], ids=["unknown-key", "missing", "null", "negative", "count", "link", "generation"])
def test_a_card_that_does_not_read_is_one_error_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     card: dict[str, object], says: str) -> None:
    path = profile_with(tmp_path, card)
    code = run_cli(["launch", str(path), "--engine", "sim", "--once"])
    err = capsys.readouterr().err
    assert code != 0
    (line,) = [x for x in err.splitlines() if x.startswith("Error:")]
    assert line.startswith(f"Error: {path}: {says}"), line


def test_what_the_tune_says_of_an_unfitted_card_is_not_the_seeds_fit(tmp_path: Path) -> None:
    """The prediction's basis names the seeds' fit only where the pair was fitted to them."""
    inline = replay.profile_config(str(profile_with(tmp_path, RTX_4090)))
    assert "not fitted to any measurement" in tuning._basis(inline)
    seed = replay.profile_config("h200")
    assert "fitted to the seeds" in tuning._basis(seed)


def test_the_simulators_own_command_line_names_a_card_that_does_not_read() -> None:
    """Started by hand (`python -m campaign.sim --hardware JSON`), the same words, on --hardware."""
    with pytest.raises(ValueError, match=r"argument --hardware: a card inline needs bandwidth_gb_s, bf16_tflops"):
        sim_config.parse_checked(["--model", "meta-llama/Llama-3.1-8B", "--hardware", '{"memory_gb": 24}'])


def test_every_row_of_the_tables_names_its_source_and_reads_as_a_datasheet_does() -> None:
    """Each card's figures come with the vendor document they are from; dense FP8 and INT8 are at least the
    dense BF16 rate (twice it on every chip here that has them); and every card serves Llama 3.1 8B at 8K
    with room for the cache (the smallest here, 24 GB cards, included), its step costs computed."""
    for name, card in HARDWARE.items():
        assert card.source.startswith("https://"), name
        assert card.memory_gb > 0 and card.bandwidth_gb_s > 0 and card.link_gb_s in {32, 64, 300, 448, 450, 900}, name
        assert card.int8_tops >= card.bf16_tflops and (card.fp8_tflops or card.bf16_tflops) >= card.bf16_tflops
        mem = sim_model.memory(hardware=name, model="meta-llama/Llama-3.1-8B", tp=1, utilization=0.9,
                               max_num_batched_tokens=2048)
        assert mem.kv_tokens > 8192, (name, mem)
        assert sim_model.step_costs(hardware=name, model="meta-llama/Llama-3.1-8B", tp=1).fixed_s > 0


def test_tensor_parallelism_pays_two_all_reduces_a_layer_over_the_cards_link() -> None:
    """Llama-2-70B (80 layers, hidden 8192, from its shipped config.json) on four H100s: each token sends its
    hidden state's 16,384 bytes 160 times, 2 x 3/4 of them by a ring, over the link: the same card joined by PCIe
    5.0 (64 GB/s) instead of NVLink (450) pays more per token by exactly the bytes over the slower link, and
    nothing more per step. One card pays nothing, and a seed's pair (fitted on its own tensor parallelism) no
    separate term."""
    model = "meta-llama/Llama-2-70b-hf"
    h100 = {"name": "h100-on-pcie", "memory_gb": 80, "bandwidth_gb_s": 3350, "bf16_tflops": 989.5,
            "fp8_tflops": 1979, "int8_tops": 1979, "reported_gib": 79.22, "count": 4}
    nvlink = sim_model.step_costs(hardware="h100-sxmx4", model=model, tp=4)
    pcie = sim_model.step_costs(hardware=json.dumps({**h100, "link_gb_s": 64}), model=model, tp=4)
    alone = sim_model.step_costs(hardware="h100-sxm", model=model, tp=4)   # the row's link, stated per card
    assert nvlink == alone
    per_token_bytes = 160 * 8192 * 2 * (2 * 3 / 4)
    assert pcie.fixed_s == pytest.approx(nvlink.fixed_s)
    assert pcie.prefill_s_per_token - nvlink.prefill_s_per_token == pytest.approx(
        per_token_bytes / 64e9 - per_token_bytes / 450e9)
    assert pcie.decode_s_per_token - nvlink.decode_s_per_token == pytest.approx(
        per_token_bytes / 64e9 - per_token_bytes / 450e9)
    one = sim_model.step_costs(hardware="h100-sxm", model=model, tp=1)
    assert nvlink.prefill_s_per_token - one.prefill_s_per_token / 4 == pytest.approx(per_token_bytes / 450e9)
    cal = sim_model.calibration_for("h100-sxm", model)
    assert cal.link_term and nvlink.fixed_s == pytest.approx(cal.fixed_step_s + (one.fixed_s - cal.fixed_step_s) / 4)
    seed = sim_model.calibration_for("a5000x2", "qwen-27b-hybrid")
    assert not seed.link_term
    card, _ = resolve_hardware("a5000x2") or (HARDWARE["l4"], 0)
    assert sim_model.tp_link(seed, card, sim_model.require_shape("qwen-27b-hybrid"), 2) == 0.0


def test_a_cards_generation_sets_the_share_of_its_bandwidth_a_step_reads_at() -> None:
    """The unfitted roofline reads memory at a share of the datasheet's bandwidth fitted by generation (Hopper's
    on H100 runs, Ampere's on an A100's, Ada's on an L40S's: `make fidelity --fit`): an A100's weights take that
    share's time, and an RTX 4090 is read at Ada's share, the A5000 (with a model no seed fitted) at Ampere's;
    a card stated inline without its generation is read as Hopper."""
    model = "meta-llama/Llama-3.1-8B"
    steps = sim_model.UNFITTED_STEPS
    assert sim_model.calibration_for("a100-80gb-sxm", model).bandwidth_efficiency == steps.ampere_bandwidth_efficiency
    assert sim_model.calibration_for("l40s", model).bandwidth_efficiency == steps.ada_bandwidth_efficiency
    assert sim_model.calibration_for("rtx-4090", model).bandwidth_efficiency == steps.ada_bandwidth_efficiency
    assert sim_model.calibration_for("a5000", model).bandwidth_efficiency == steps.ampere_bandwidth_efficiency
    assert sim_model.calibration_for("h100-sxm", model).bandwidth_efficiency == steps.bandwidth_efficiency
    assert sim_model.calibration_for("b200", model).bandwidth_efficiency == steps.bandwidth_efficiency
    inline = {k: v for k, v in RTX_4090.items() if k != "generation"}
    assert sim_model.calibration_for(json.dumps(inline), model).bandwidth_efficiency == steps.bandwidth_efficiency
    # The fixed part of a step on one A100 is the fixed cost and the weights (16.06 GB in BF16) at that share.
    costs = sim_model.step_costs(hardware="a100-80gb-sxm", model=model, tp=1)
    weights = sim_model.require_shape(model).params_b * 1e9 * 2
    assert costs.fixed_s == pytest.approx(steps.fixed_step_s + weights / (2039e9 * steps.ampere_bandwidth_efficiency),
                                          rel=0.01)


def test_a_count_of_cards_is_the_digits_after_the_last_x() -> None:
    """`a5000x2` is two RTX A5000s; MI300X is one card of its own name, and `mi300xx8` eight of them."""
    assert [(c.name, n) for c, n in (resolve_hardware(x) or (HARDWARE["l4"], 0)
                                     for x in ("a5000x2", "mi300x", "mi300xx8", "rtx-4090", "3090x2"))] == [
        ("rtx-a5000", 2), ("mi300x", 1), ("mi300x", 8), ("rtx-4090", 1), ("rtx-3090", 2)]
