"""``taste-cl bench personalize``: a tiny run yields every column for every method, each
method trains exactly what it claims (frozen tensors stay bit-identical), and the device rows
(the clipped learner exported with ``onnx_engine`` before the stream) train as torch does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from taste_cl.adapters.device import load_learner
from taste_cl.adapters.device.artifacts import read_manifest
from taste_cl.benchmarks import personalize
from taste_cl.benchmarks.personalize import (
    METHODS,
    _artifact_cell,
    build_cnn,
    choose_lr,
    criteria,
    device_criteria,
    device_table,
    export_devices,
    parse_args,
    prepare,
    trainable_count,
)

pytest.importorskip("peft")

TINY = [
    "--width", "4", "--pretrain-steps", "3", "--pretrain-samples", "64", "--users", "2", "--user-classes", "2",
    "--user-samples", "32", "--test-samples", "32", "--steps", "3", "--batch-size", "8", "--lrs", "0.001,0.01",
    "--reselect-every", "2", "--no-progress",
]  # fmt: skip
COLUMNS = ("lr", "trainable", "% of full", "lift (pts)", "retention", "ms/step", "speedup", "w/ probes", "train MiB", "ORT", "ExecuTorch")


def _run(tmp_path: Path, *extra: str) -> dict:
    assert personalize.main([*TINY, "--out", str(tmp_path), *extra]) == 0
    return json.loads((tmp_path / "personalize.json").read_text())


@pytest.mark.training_build
def test_tiny_run_reports_every_number_for_every_method(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = _run(tmp_path, "--backends", "onnxruntime", "--device-methods", "none")  # the device rows: tested below
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("method"))
    assert all(column in header for column in COLUMNS)
    assert [line.split()[0] for line in out.splitlines() if line.split() and line.split()[0] in METHODS] == list(METHODS)
    assert (tmp_path / "personalize.png").stat().st_size > 0
    summary = result["methods"]
    assert set(summary) == set(METHODS)
    for method, row in summary.items():
        for key in ("lift_points", "retention", "median_step_s", "mean_step_s", "speedup", "trainable_params", "trainable_share",
                    "training_memory_bytes"):  # fmt: skip
            assert isinstance(row[key], float | int), (method, key)
        scores = {float(lr): score for lr, score in result["lr_sweep"][method].items()}
        assert set(scores) == {0.001, 0.01} and row["lr"] == choose_lr(scores, result["config"]["test_samples"])
        ort = row["artifacts"]["onnxruntime"]
        assert (ort["bytes"] or 0) > 0 or ort["refused"], method
        assert "executorch" not in row["artifacts"]
    assert summary["full"]["speedup"] == 1.0
    # the ORT-costed selection is made once on the host and fixed: every user trains the same tensors, a subset
    chosen = result["ort_selection"]["trainable"]
    assert result["ort_selection"]["ort_predicted_speedup"] >= 1.0 and f"(elastic_0.5_ort) trains {len(chosen)} tensors" in out
    assert summary["elastic_0.5_ort"]["trainable_params"] == sum(p.numel() for n, p in build_cnn(4).named_parameters() if n in chosen)
    assert summary["full"]["trainable_params"] == sum(p.numel() for p in build_cnn(4).parameters())
    head = sum(p.numel() for p in build_cnn(4).head.parameters())
    assert summary["full"]["trainable_share"] == 1.0 and summary["last_layer"]["trainable_share"] == head / summary["full"]["trainable_params"]
    # the targets, computed from this run's table and printed under it
    assert [c["holds"] for c in result["criteria"]] == [c["holds"] for c in criteria(summary)]
    assert all(isinstance(c["holds"], bool) for c in result["criteria"])
    assert "issue #31's targets" in out and f"lora trains <= 10 % of full's parameters: {100 * summary['lora']['trainable_share']:.1f} %" in out
    assert len(result["per_user"]) == 2 and result["users"][0]["own_label"] in (8, 9)
    assert result["summary"].startswith("lift over the pretrained CNN")  # the README row
    assert "not run" in out  # the ExecuTorch column says it was not exported
    assert result["device"]["methods"] == {} and "device rows" not in out and "issue #44" not in out


def _needs_engine() -> None:
    for module in ("onnx", "onnxscript", "onnxruntime"):
        pytest.importorskip(module)


def test_device_rows_train_the_exported_clipped_learner_as_torch_does(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The quick path of the device rows: full and LoRA, clipped, exported before the stream, trained on the device."""
    _needs_engine()
    result = _run(tmp_path, "--methods", "full,lora", "--backends", "none")
    out = capsys.readouterr().out
    assert "device row full: exported to onnx_engine" in out and "device row lora: exported to onnx_engine" in out
    table_lines = out[out.index("== device rows (onnx_engine") :].splitlines()
    assert table_lines[1].startswith("device row") and [line.split()[0] for line in table_lines[3:5]] == ["full", "lora"]
    device = result["device"]["methods"]
    for method in ("full", "lora"):
        row = device[method]
        assert row["export"]["refused"] is None and row["export"]["bytes"] > 0 and row["export"]["warnings"] == []  # no BatchNorm here
        assert row["trainable_params"] == result["methods"][method]["trainable_params"]  # the device trains what torch trains
        assert abs(row["gap_points"]) <= 1 and row["torch_lift_points"] == result["methods"][method]["lift_points"]
        for user, torch_user in zip(result["device"]["per_user"], result["per_user"]):
            assert abs(user[method]["accuracy_after"] - torch_user[method]["accuracy_after"]) <= 0.01
    assert [c["holds"] for c in result["device"]["criteria"]] == [True, True]
    assert "issue #44's targets" in out and "full, clipped to norm 1, exports to onnx_engine" in out


def test_the_device_export_carries_clipping_and_continues_as_torch(tmp_path: Path) -> None:
    """The exported learner keeps the rate and the clipping, and three clipped steps on the device match torch's to float noise."""
    _needs_engine()
    args = parse_args(["--device-methods", "full", "--max-grad-norm", "0.5"])
    torch.manual_seed(0)
    pretrained = build_cnn(4)
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.rand(8, 3, 32, 32, generator=generator), torch.randint(0, 10, (8,), generator=generator)) for _ in range(3)]
    (entry,) = export_devices(pretrained, {"full": 0.05}, batches[0], args, tmp_path).values()
    assert entry["refused"] is None
    settings = read_manifest(entry["path"])["settings"]
    assert settings["max_grad_norm"] == 0.5 and settings["lr"] == 0.05 and settings["replay"] is None
    device, learner = load_learner(entry["path"]), prepare("full", pretrained, 0.05, args, None)
    for batch in batches:
        learner.observe(batch)
        device.observe(batch)
    x = batches[0][0]
    with torch.no_grad():
        expected = learner.model.eval()(x).numpy()
    assert abs(device.predict(x.numpy()) - expected).max() < 1e-4


def test_a_refused_device_export_is_a_cell_and_fails_its_target() -> None:
    refused = {"export": {"bytes": None, "refused": "ExportError: the onnx_engine backend steps torch.optim.SGD or AdamW; ..."}}
    table_text = device_table({"lora": refused})
    assert "refused (ExportError)" in table_text and table_text.splitlines()[2].split()[:2] == ["lora", "-"]
    (found,) = device_criteria({"lora": refused}, 1.0)
    assert found["holds"] is False and found["numbers"] == "export refused: ExportError"


def test_device_methods_follow_the_methods_run(monkeypatch: pytest.MonkeyPatch) -> None:
    args = parse_args(["--methods", "full,last_layer", "--device-methods", "full,lora"])
    assert args.device_methods == ["full"] and args.notes == ["no lora device row: lora is not run"]
    assert parse_args([]).device_methods == ["full", "lora", "elastic_0.5"] and parse_args(["--device-methods", "none"]).device_methods == []
    monkeypatch.setattr(personalize, "find_spec", lambda name: None)  # peft not installed: lora left out, saying why
    args = parse_args([])
    assert "lora" not in args.methods and args.device_methods == ["full", "elastic_0.5"]
    assert args.notes[0] == "lora left out: peft is not installed: pip install 'taste-cl[peft]'"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--methods", "full,adapters"], "unknown methods"),
        (["--backends", "tflite"], "choose from onnxruntime"),
        (["--device-methods", "elastic_0.3"], "choose from last_layer, bias_only, lora, elastic_0.5, elastic_0.5_ort, full or 'none'"),
    ],
)
def test_bad_options_are_usage_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def _trained_names(method: str, model: torch.nn.Module) -> set[str]:
    names = {name for name, _ in model.named_parameters()}
    if method == "last_layer":
        return {"head.weight", "head.bias"}
    if method == "bias_only":
        return {n for n in names if n.endswith(".bias")} | {"head.weight"}
    if method == "lora":
        return {n for n in names if "lora_" in n or n.endswith(("head.weight", "head.bias"))}
    if method == "elastic_0.5_ort":
        return {"conv6.weight", "head.bias"}
    return names


@pytest.mark.parametrize("method", ["last_layer", "bias_only", "lora", "elastic_0.5_ort", "full"])
def test_each_method_trains_only_what_it_claims(method: str) -> None:
    args = parse_args(["--lora-rank", "2"])
    args.ort_selection = {"trainable": ["conv6.weight", "head.bias"]}  # what run() measures with ONNX Runtime
    torch.manual_seed(0)
    pretrained = build_cnn(4)
    original = [p.detach().clone() for p in pretrained.parameters()]
    learner = prepare(method, pretrained, 0.05, args, None)
    trained = _trained_names(method, learner.model)
    before = {name: p.detach().clone() for name, p in learner.model.named_parameters()}
    assert trainable_count(learner) == sum(p.numel() for n, p in learner.model.named_parameters() if n in trained)
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        learner.observe((torch.randn(8, 3, 32, 32, generator=generator), torch.randint(0, 10, (8,), generator=generator)))
    for name, parameter in learner.model.named_parameters():
        changed = not torch.equal(parameter, before[name])
        if name in trained and "lora_A" not in name:  # lora_A stays put until lora_B (zero at start) has moved
            assert changed, f"{method}: {name} should train"
        elif name not in trained:
            assert not changed, f"{method}: {name} is frozen but changed"
    assert all(torch.equal(p, q) for p, q in zip(pretrained.parameters(), original))  # each method trains a copy


def test_lora_at_the_default_size_trains_under_a_tenth() -> None:
    args = parse_args([])
    pretrained = build_cnn(args.width)
    full, lora = (trainable_count(prepare(m, pretrained, 0.01, args, None)) for m in ("full", "lora"))
    assert full == sum(p.numel() for p in pretrained.parameters()) == 72_730
    # rank 3 on the six convs (1,691 per rank) plus the whole head (650): 7.9 % of full's (rank 4: 10.2 %)
    assert lora == 5_723 and lora <= 0.10 * full


def _summary(elastic: tuple[float, float] | None, last_layer: float | None, lora: tuple[float, float]) -> dict[str, dict[str, float]]:
    """A summary with full at +26.0 points; elastic_0.5 (lift, speedup), last_layer's lift, lora (lift, share); None: not run."""
    row = {"lift_points": 26.0, "speedup": 1.0, "trainable_share": 1.0}
    summary = {"full": row, "lora": {**row, "lift_points": lora[0], "trainable_share": lora[1]}}
    if elastic is not None:
        summary["elastic_0.5"] = {**row, "lift_points": elastic[0], "speedup": elastic[1]}
    if last_layer is not None:
        summary["last_layer"] = {**row, "lift_points": last_layer}
    return summary


@pytest.mark.parametrize(
    ("summary", "holds"),
    [
        # numbers like a loaded default run's: every target met
        (_summary((29.1, 1.75), 23.6, (25.9, 0.079)), [True, True, True, True, True]),
        # at the boundaries: exactly 1 / 2 points below, exactly 1.6x, exactly 10 %; elastic only tied with last_layer
        (_summary((25.0, 1.6), 25.0, (24.0, 0.10)), [True, True, False, True, True]),
        # LoRA at rank 4 (10.2 % of full's parameters) 2.1 points below; elastic too slow and 1.1 points below
        (_summary((24.9, 1.5), 20.0, (23.9, 0.102)), [False, False, True, False, False]),
        # methods left out (--methods): the targets comparing them are not judged
        (_summary(None, None, (25.0, 0.05)), [None, None, None, True, True]),
    ],
)
def test_criteria_are_computed_from_the_table(summary: dict[str, dict[str, float]], holds: list[bool | None]) -> None:
    found = criteria(summary)
    assert [c["holds"] for c in found] == holds
    assert found[-1]["numbers"] == f"{100 * summary['lora']['trainable_share']:.1f} %"
    assert found[3]["numbers"] == f"{summary['lora']['lift_points']:+.1f} vs +26.0 pts"
    if "elastic_0.5" not in summary:
        assert found[0]["numbers"] == "not run: elastic_0.5" and found[2]["numbers"] == "not run: elastic_0.5, last_layer"


def test_elastic_trains_a_subset(tmp_path: Path) -> None:
    args = parse_args(["--reselect-every", "2"])
    learner = prepare("elastic_0.3", build_cnn(4), 0.05, args, str(tmp_path))
    everything = trainable_count(learner)
    generator = torch.Generator().manual_seed(0)
    for _ in range(4):
        learner.observe((torch.randn(8, 3, 32, 32, generator=generator), torch.randint(0, 10, (8,), generator=generator)))
    assert 0 < trainable_count(learner) < everything


def test_artifact_cells_name_the_size_or_the_refusals_type() -> None:
    refused = {"bytes": None, "refused": "ParityError: refusing to publish: executorch parity FAILED over 20 steps: ..."}
    artifacts = {"onnxruntime": {"bytes": 903823, "refused": None}, "executorch": refused}
    assert _artifact_cell(artifacts, "onnxruntime") == "883 KiB"
    assert _artifact_cell(artifacts, "executorch") == "refused (ParityError)"  # the message stays in the JSON
    assert _artifact_cell(None, "onnxruntime") == _artifact_cell(artifacts, "web") == "not run"


def test_elastic_methods_drop_a_leaving_units_momentum_unless_told_to_keep_it(tmp_path: Path) -> None:
    for flags, policy in (([], "reset"), (["--elastic-optimizer-state", "keep"], "keep")):
        learner = prepare("elastic_0.5", build_cnn(4), 0.05, parse_args(flags), str(tmp_path))
        assert learner.plugins[0].optimizer_state == policy


@pytest.mark.slow
def test_both_backends_export_every_method(tmp_path: Path) -> None:
    """ONNX Runtime publishes every method; ExecuTorch publishes or its parity gate refuses with the
    reason in the cell (in the helper's loaded run it refused last_layer, lora, elastic_0.3 and full)."""
    pytest.importorskip("executorch")
    result = _run(tmp_path, "--users", "1", "--lrs", "0.01")
    for method, row in result["methods"].items():
        entry = row["artifacts"]["onnxruntime"]
        assert entry["refused"] is None and entry["bytes"] > 0, (method, entry)
        entry = row["artifacts"]["executorch"]
        assert (entry["refused"] is None and entry["bytes"] > 0) or (isinstance(entry["refused"], str) and entry["refused"]), (method, entry)
    sizes = {method: row["artifacts"]["onnxruntime"]["bytes"] for method, row in result["methods"].items()}
    assert sizes["last_layer"] < sizes["full"]  # a smaller trainable set, a smaller artifact


@pytest.mark.parametrize(
    ("accuracy", "chosen"),
    [
        ({0.001: 0.994, 0.003: 0.996, 0.01: 0.998, 0.03: 0.978}, 0.003),  # one sample behind the best: the smaller rate
        ({0.001: 0.99, 0.003: 0.994, 0.01: 0.998, 0.03: 0.996}, 0.01),  # two samples behind: out
        ({0.003: 0.9959999918937683, 0.01: 0.9980000257492065}, 0.003),  # float32 accuracies one sample apart
        ({0.001: 0.5, 0.003: 0.8, 0.01: 0.9, 0.03: 0.2}, 0.01),  # a clear best (its standard error is 0.013)
        ({0.001: 0.89, 0.003: 0.9, 0.01: 0.2}, 0.001),  # within one standard error (0.013) of the best
        ({0.001: 0.88, 0.003: 0.9, 0.01: 0.2}, 0.003),  # two points behind: more than one standard error
        ({0.03: 1.0, 0.01: 1.0}, 0.01),  # ties: the smallest
    ],
)
def test_choose_lr_takes_the_smallest_rate_within_one_standard_error_of_the_best(accuracy: dict[float, float], chosen: float) -> None:
    assert choose_lr(accuracy, 500) == chosen
