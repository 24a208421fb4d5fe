"""The benchmark's workloads (``parallel_modules._cases``) checked on the CPU.

The benchmark checks every mode against the sequential module before timing
it; these tests run the same checks on every case at a small batch, so a case
that stops matching its reference fails CI, not only a GPU run.
"""
import argparse

import pytest
import torch
from torch import nn

from parallel_modules import Parallel, ParallelSequential
from parallel_modules._cases import CASES, PIPELINES, SequentialBranches
from parallel_modules.bench import main


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_case_in_parallel_equals_its_sequential_module(name):
    case = CASES[name]
    branches = case.branches("cpu", torch.float32)
    seq = case.model(SequentialBranches(branches, case.join, case.dim), "cpu", torch.float32)
    par = case.model(Parallel(*branches, join=case.join, dim=case.dim), "cpu", torch.float32)
    x = case.make_input(2, "cpu", torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(par(x), seq(x), rtol=0, atol=0)


def test_a_case_with_a_trunk_puts_the_same_trunk_in_front_of_every_mode():
    case = CASES["heads"]
    assert case.trunk is not None
    branches = case.branches("cpu", torch.float32)
    a = case.model(Parallel(*branches), "cpu", torch.float32)
    b = case.model(SequentialBranches(branches), "cpu", torch.float32)
    assert isinstance(a, nn.Sequential) and a[1] is not b[1]
    for pa, pb in zip(a[0].parameters(), b[0].parameters(), strict=True):
        assert torch.equal(pa, pb)
    x = case.make_input(3, "cpu", torch.float32)
    with torch.no_grad():
        # The heads see the trunk's features, not the input.
        torch.testing.assert_close(a(x), SequentialBranches(branches)(a[0](x)), rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_every_pipeline_case_equals_its_sequential_module(name):
    case = PIPELINES[name]
    stages = case.stages("cpu", torch.float32)
    x = case.make_input(max(case.chunks), "cpu", torch.float32)
    with torch.no_grad():
        ref = nn.Sequential(*stages)(x)
        for chunks in case.chunks:
            # Micro-batches may take other kernels than the whole batch: close, not equal.
            torch.testing.assert_close(ParallelSequential(*stages, chunks=chunks)(x), ref, rtol=1e-4, atol=1e-4)


def test_the_bench_command_checks_and_tables_a_case_on_the_cpu(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU suite, on a GPU machine too
    assert main(["--case", "heads", "--reps", "2", "--group", "1"]) == 0
    out = capsys.readouterr().out
    assert "no CUDA GPU found" in out
    rows = [line for line in out.splitlines() if line.startswith("heads")]
    assert [r.split()[3:5] for r in rows][:2] == [["eager", "seq"], ["eager", "Parallel"]]
    assert rows[0].endswith("reference") and rows[1].endswith("equal") and "close(" in rows[2]
    # How fast the host ran while the case was timed (CPU-bound figures move with it).
    (probe,) = [line for line in out.splitlines() if "host probe" in line]
    assert 0 < float(probe.split()[-1]) < 1e5


@pytest.mark.parametrize("case", ["heads", "mlp8-train"])
def test_the_bench_json_says_how_each_parallel_mode_ran(case, tmp_path, monkeypatch):
    import json

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    path = tmp_path / "bench.json"
    assert main(["--case", case, "--reps", "2", "--group", "1", "--json", str(path)]) == 0
    (result,) = json.loads(path.read_text())["results"]
    modes = result["modes"]
    assert "schedules" not in modes["eager seq"]  # (no Parallel in it)
    # (A training step is a closure around its model, a heads mode the branches behind a trunk:
    # the model's Parallel is found all the same.)
    assert modes["eager Parallel"]["schedules"] == ["unfused, sequential"]
    assert modes["eager Parallel fused"]["schedules"] == ["fused, sequential"]


def test_the_bench_command_refuses_what_it_cannot_run(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_:  # a median and a spread need two samples
        main(["--case", "heads", "--reps", "1"])
    assert exit_.value.code == 2 and "--reps must be at least 2" in capsys.readouterr().err
    # Each flag's error names it alone and the value given (--group 0 read as a complaint about --reps).
    with pytest.raises(SystemExit):
        main(["--case", "heads", "--group", "0"])
    err = capsys.readouterr().err
    assert "--group must be at least 1 (calls per sample), got 0" in err and "--reps" not in err.splitlines()[-1]
    # Cases too slow for the CPU suite are named, not dropped in silence with an empty table.
    assert main(["--case", "compute", "--dtype", "fp16"]) == 2
    out, err = capsys.readouterr()
    assert "skipping compute without a CUDA GPU" in out and "float32 only" in out and "nothing left" in err


def test_the_bench_command_refuses_bad_sizes_and_paths_before_measuring(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        main(["--case", "heads", "--batch", "0"])
    assert "--batch must be at least 1, got 0" in capsys.readouterr().err
    missing = tmp_path / "no-such-folder" / "bench.json"
    with pytest.raises(SystemExit):
        main(["--case", "heads", "--json", str(missing)])
    assert "cannot write" in capsys.readouterr().err and not missing.parent.exists()
    # A pipeline's chunk counts larger than the batch are left out, not a traceback.
    assert main(["--case", "encdec", "--batch", "1", "--reps", "2", "--group", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("encdec")]
    assert [r.split()[3:] [:2] for r in rows] == [["eager", "seq"], ["ParallelSequential", "chunks=1"]]


@pytest.fixture
def measured(monkeypatch) -> list:
    r"""The cases the bench command measures on the CPU suite, recorded instead of run (none, where it refuses)."""
    import parallel_modules.bench as bench

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cases: list = []
    monkeypatch.setattr(bench, "run_case", lambda *a, **k: cases.append(a))
    return cases


def test_the_bench_command_refuses_a_folder_or_a_shared_file_for_its_outputs(capsys, measured, tmp_path):
    # (A folder passed the check of its parent, then failed to open after the first case.)
    for flag in ("--json", "--plot"):
        with pytest.raises(SystemExit):
            main(["--case", "heads", flag, str(tmp_path)])
        assert f"{flag} {str(tmp_path)!r} is a folder" in capsys.readouterr().err
    # The plot, written last, would have replaced the JSON's figures.
    same = str(tmp_path / "bench.out")
    with pytest.raises(SystemExit):
        main(["--case", "heads", "--json", same, "--plot", same])
    assert "--json and --plot both name" in capsys.readouterr().err
    assert measured == [] and list(tmp_path.iterdir()) == []


def test_the_bench_command_refuses_an_output_it_cannot_write_before_measuring(capsys, monkeypatch, measured,
                                                                            tmp_path):
    import parallel_modules.bench as bench

    # (A folder that exists but refuses the file -- permissions, a read-only file system, /proc --
    # made it a traceback after the first case; patched, as root may write where the mode bits say no.)
    real_open = open

    def refuse(path, *args, **kwargs):
        if str(path).endswith(".refused"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(bench, "open", refuse, raising=False)
    for flag in ("--json", "--plot"):
        with pytest.raises(SystemExit):
            main(["--case", "heads", flag, str(tmp_path / "bench.refused")])
        assert f"{flag}: cannot write {str(tmp_path / 'bench.refused')!r} (Permission denied)" in capsys.readouterr().err
    # The check leaves no file behind where none was, and a file that was there as it was.
    kept = tmp_path / "kept.json"
    kept.write_text("figures")
    for json_path in (tmp_path / "new.json", kept):
        with pytest.raises(SystemExit):
            main(["--case", "heads", "--json", str(json_path), "--plot", str(tmp_path)])
        capsys.readouterr()
    assert measured == [] and sorted(f.name for f in tmp_path.iterdir()) == ["kept.json"]
    assert kept.read_text() == "figures"


def test_the_bench_commands_write_check_leaves_a_link_to_nothing_as_it_was(tmp_path):
    # A symbolic link to a file not yet made: the check opened it (making the file at its target),
    # then removed the link, and left the made file behind.
    from parallel_modules.bench import _unwritable

    link = tmp_path / "bench.json"
    link.symlink_to(tmp_path / "later.json")
    assert _unwritable(str(link)) is None
    assert link.is_symlink() and not (tmp_path / "later.json").exists()


def test_the_bench_plot_draws_every_cases_modes_not_only_the_firsts(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.figure

    import parallel_modules.bench as bench

    def result(case, **speedups):
        return {"case": case, "batch": 2, "dtype": "float32",
                "modes": {name: {"speedup_vs_eager_seq": s} for name, s in {"eager seq": 1.0, **speedups}.items()}}

    saved = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, path, **kw: saved.append(fig))
    # (A Parallel case and a pipeline case have no mode in common but the reference.)
    bench._plot([result("tiny2", **{"eager Parallel": 0.9}),
                 result("encdec", **{"ParallelSequential chunks=2": 1.5})], str(tmp_path / "bench.png"))
    (ax,) = saved[0].axes
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["eager Parallel", "ParallelSequential chunks=2"]
    heights = [[bar.get_height() for bar in bars] for bars in ax.containers]
    assert heights[0][0] == 0.9 and heights[1][1] == 1.5  # (each on its own case; NaN, no bar, on the other)


def test_the_bench_command_says_a_plot_needs_matplotlib_before_measuring(capsys, monkeypatch, measured, tmp_path):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # (an import of it then raises ImportError)
    with pytest.raises(SystemExit, match=r"--plot needs matplotlib.*pip install 'parallel_modules\[plot\]'"):
        main(["--case", "heads", "--plot", str(tmp_path / "bench.png")])
    assert measured == [] and list(tmp_path.iterdir()) == []


def test_the_bench_command_names_a_case_that_no_mode_filter_matches(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["--case", "tiny8", "--mode", "fuzed", "--mode", "graph", "--reps", "2", "--group", "1"]) == 0
    err = capsys.readouterr().err
    assert "no mode of tiny8 contains 'fuzed' or 'graph'" in err and "eager Parallel fused" in err
    assert main(["--case", "tiny8", "--mode", "fused", "--reps", "2", "--group", "1"]) == 0
    assert "no mode" not in capsys.readouterr().err
    # A filter naming the reference itself ("eager seq") is no typo: nothing to say.
    assert main(["--case", "tiny8", "--mode", "seq", "--reps", "2", "--group", "1"]) == 0
    assert "no mode" not in capsys.readouterr().err


def test_the_bench_checks_refuse_a_wrong_shape_that_would_broadcast():
    from parallel_modules.bench import _check

    ref = torch.ones(1, 8, 10)
    assert _check("'c'", "eager Parallel fused", ref.clone(), ref, torch.float32, True) == "close(1e-05): 0"
    for out in (torch.ones(8, 10), torch.ones(1, 8, 10, dtype=torch.float64)):
        with pytest.raises(AssertionError, match="eager Parallel fused.* returned"):
            _check("'c'", "eager Parallel fused", out, ref, torch.float32, True)


def _wrapped_mode(monkeypatch, mode: str, change) -> None:
    r"""Patch the bench so that mode ``mode`` returns ``change(output)`` (eager modes, pipelines: by name)."""
    import parallel_modules.bench as bench

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for builder in ("_modes", "_pipeline_modes"):
        def modes(*args, _real=getattr(bench, builder)):
            out = _real(*args)
            if mode in out:
                out[mode] = lambda x, _fn=out[mode]: change(_fn(x))
            return out

        monkeypatch.setattr(bench, builder, modes)


@pytest.mark.parametrize("case, mode", [("mlp8", "eager Parallel fused"), ("heads", "eager Parallel fused"),
                                        ("encdec", "ParallelSequential chunks=2")])
def test_the_bench_check_catches_a_mode_off_by_a_tenth_of_a_percent(monkeypatch, case, mode):
    # Outputs of magnitude 0.02-0.1: an absolute tolerance of 1e-4 let this pass.
    _wrapped_mode(monkeypatch, mode, lambda out: out * 1.001)
    pattern = (rf"case '{case}' \(batch 2, float32\), mode '{mode}' differs from the sequential module "
               r"\(max abs error .*, 0.001 of the reference's largest magnitude .*; tolerance 1e-05 of it")
    with pytest.raises(AssertionError, match=pattern):
        main(["--case", case, "--batch", "2", "--reps", "2", "--group", "1"])


def test_the_bench_check_catches_an_exact_mode_one_unit_in_the_last_place_off(monkeypatch):
    def nudged(out):  # the largest element, one float32 step away from zero: within any tolerance
        out = out.clone()
        i = out.abs().argmax()
        out.view(-1)[i] = torch.nextafter(out.view(-1)[i], torch.zeros(()))
        return out

    _wrapped_mode(monkeypatch, "eager Parallel", nudged)
    with pytest.raises(AssertionError, match=r"case 'tiny8' \(batch 8, float32\), mode 'eager Parallel' differs.*"
                                             r"must be bit-for-bit equal"):
        main(["--case", "tiny8", "--reps", "2", "--group", "1"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scale", [2.0 ** -10, 1.0, 2.0 ** 10])  # (exact in every dtype)
def test_the_bench_check_scales_its_tolerance_to_the_output_and_says_by_how_much_it_failed(dtype, scale):
    from parallel_modules.bench import _TOLERANCE, _check

    ref = (torch.linspace(-1, 1, 101) * scale).to(dtype)
    # Rounding of another summation order: half the tolerance, at every magnitude.
    inside = (ref.double() + 0.5 * _TOLERANCE[dtype] * scale).to(dtype)
    found = _check("'c'", "compile", inside, ref, dtype, True)
    assert found.startswith(f"close({_TOLERANCE[dtype]:g}): ") and 0 < float(found.split(": ")[1]) <= _TOLERANCE[dtype]
    # Twice the tolerance: refused, with what a too tight tolerance on a GPU needs to be told apart from a bug.
    outside = (ref.double() + 2 * _TOLERANCE[dtype] * scale).to(dtype)
    with pytest.raises(AssertionError) as e:
        _check("'c' (batch 8, fp)", "graph Parallel fused", outside, ref, dtype, True)
    message = str(e.value)
    assert "case 'c' (batch 8, fp), mode 'graph Parallel fused' differs" in message
    assert f"largest magnitude {scale:.3g}; tolerance {_TOLERANCE[dtype]:g} of it in {dtype}" in message
    assert f"widen bench._TOLERANCE[{dtype}]" in message
    rel = float(message.split("max abs error ")[1].split(", ")[1].split(" of")[0])
    assert 1.5 * _TOLERANCE[dtype] < rel < 2.5 * _TOLERANCE[dtype]


def test_the_bench_check_refuses_nan_in_a_mode_that_may_round_differently():
    from parallel_modules.bench import _check

    ref = torch.ones(4)
    out = ref.clone()
    out[1] = float("nan")
    with pytest.raises(AssertionError, match="max abs error nan"):
        _check("'c'", "eager Parallel fused", out, ref, torch.float32, True)


def test_the_bench_check_takes_infinities_met_by_the_same_and_empty_outputs():
    from parallel_modules.bench import _check

    ref = torch.tensor([1.0, float("inf"), -float("inf"), 0.5])
    assert _check("'c'", "eager Parallel", ref.clone(), ref, torch.float32, True) == "equal"
    assert _check("'c'", "eager Parallel fused", ref.clone(), ref, torch.float32, True) == "close(1e-05): 0"
    # An infinity in the reference does not make every error "close": scaled by the finite elements.
    off = ref.clone()
    off[3] = 0.6
    with pytest.raises(AssertionError, match="max abs error 0.1"):
        _check("'c'", "eager Parallel fused", off, ref, torch.float32, True)
    empty = torch.ones(0, 8)
    assert _check("'c'", "eager Parallel fused", empty.clone(), empty, torch.float32, True) == "close(1e-05): 0"


def test_the_bench_check_catches_a_mode_that_ignores_new_values_in_its_input(monkeypatch):
    import parallel_modules.bench as bench

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    modes = bench._modes

    def stale(case, device, dtype, x, quick):  # a replay that kept its first result (a stale input buffer)
        out = modes(case, device, dtype, x, quick)
        real, memo = out["eager Parallel"], []

        def run(inp):
            if not memo:
                memo.append(real(inp))
            return memo[0]

        out["eager Parallel"] = run
        return out

    assert main(["--case", "tiny8", "--reps", "2", "--group", "1"]) == 0  # (the unbroken modes pass)
    monkeypatch.setattr(bench, "_modes", stale)
    with pytest.raises(AssertionError, match="mode 'eager Parallel' differs from the sequential module"):
        main(["--case", "tiny8", "--reps", "2", "--group", "1"])


@pytest.mark.parametrize("broken", ["no backward", "no step", "other gradients"])
def test_the_bench_training_check_catches_a_step_that_does_not_train_as_the_sequential_one(monkeypatch, broken):
    import parallel_modules.bench as bench

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    train_modes = bench._train_modes

    def modes(case, device, dtype):
        out = train_modes(case, device, dtype)
        model = out["eager Parallel fused"].module
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)

        def run(x):
            opt.zero_grad(set_to_none=True)
            if broken == "no backward":
                with torch.no_grad():
                    model(x)
                return model
            loss = model(x).square().mean()
            (loss * (1.001 if broken == "other gradients" else 1)).backward()
            if broken != "no step":
                opt.step()
            return model

        run.module = model
        out["eager Parallel fused"] = run
        return out

    monkeypatch.setattr(bench, "_train_modes", modes)
    with pytest.raises(AssertionError, match="training mode 'eager Parallel fused' differs"):
        main(["--case", "mlp8-train", "--reps", "2", "--group", "1"])


def test_the_table_bounds_a_pipeline_by_its_stages_alone():
    from parallel_modules.bench import _table

    mode = {"median_us": 100.0, "iqr_us": 1.0, "speedup_vs_eager_seq": 1.0, "x_floor": None, "check": "reference"}
    result = {"case": "encdec", "batch": 8, "dtype": "float32", "floor_us": None, "modes": {"eager seq": mode},
              "stage0_us": 30.0, "stage1_us": 90.0}
    lines = _table([result]).splitlines()
    assert [line.split()[-1] for line in lines if "alone: stage" in line] == ["30.0", "90.0"]
    # Stages of 30 and 90 us overlapped perfectly leave the 90: at most 120 / 90 faster.
    (bound,) = [line for line in lines if "bound" in line]
    assert bound.split()[-1] == "1.33x"


def test_calibration_keeps_the_width_whose_time_comes_closest_and_stops_past_the_target():
    from parallel_modules.bench import _closest

    timed = []

    def time_of(w):
        timed.append(w)
        return 20.0 * w  # grows with the width, as a convolution's time does

    # 700 us: width 32 takes 640, 36 takes 720 (20 from it, against 60): 36, and 40 is never built.
    assert _closest((16, 24, 32, 36, 40, 44), time_of, 700.0) == (36, 720.0)
    assert timed == [16, 24, 32, 36]
    # Every width faster than the target: the largest; slower: the smallest.
    assert _closest((8, 16), time_of, 1e6) == (16, 320.0)
    assert _closest((8, 16), time_of, 1.0) == (8, 160.0)
    with pytest.raises(ValueError, match="at least one width"):
        _closest((), time_of, 1.0)


def test_a_pipeline_case_is_built_at_the_width_it_was_calibrated_to():
    import dataclasses

    case = PIPELINES["h2d"]
    assert case.host_input and case.widths == tuple(sorted(case.widths))
    (default,) = case.stages("cpu", torch.float32)
    (wide,) = dataclasses.replace(case, width=48).stages("cpu", torch.float32)
    assert default[0].out_channels == 32 and wide[0].out_channels == 48 and wide[2].in_channels == 48
    # Same input and output shapes: the modes and their checks do not depend on the width.
    x = case.make_input(2, "cpu", torch.float32)
    with torch.no_grad():
        assert default(x).shape == wide(x).shape


def test_calibration_times_the_copy_and_each_width_on_the_whole_batch(monkeypatch):
    import dataclasses

    from parallel_modules import bench

    case = dataclasses.replace(PIPELINES["h2d"], widths=(8, 16, 24, 32))
    x = torch.randn(2, 3, 32, 32)
    seen = []

    def fake_sample(fn, inp, group, cuda):
        # The copy returns its input's copy (a tensor of the input's shape); a model, its output,
        # whose time here grows with the first conv's width: 1 us per channel, the copy 17 us.
        out = fn(inp)
        if out.shape == inp.shape:
            return 17e-6
        width = seen[-1]
        return width * 1e-6

    real_stages = bench.PipelineCase.stages

    def stages(self, device, dtype):
        seen.append(self.width)
        return real_stages(self, device, dtype)

    monkeypatch.setattr(bench, "_sample", fake_sample)
    monkeypatch.setattr(bench.PipelineCase, "stages", stages)
    chosen = bench._calibrated(case, torch.device("cpu"), torch.float32, x)
    assert chosen.width == 16 and chosen.widths == case.widths  # 16 us against 24 for width 24
    assert seen == [8, 16, 24]


def test_the_goals_table_refuses_a_cpu_run_and_dashes_modes_a_gpu_run_lacks(tmp_path, monkeypatch):
    import json
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]

    def goals(*paths):
        return subprocess.run([sys.executable, str(root / "tools" / "goals.py"), *map(str, paths)],
                              capture_output=True, text=True)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpu = tmp_path / "cpu.json"
    assert main(["--case", "tiny8", "--reps", "2", "--group", "1", "--json", str(cpu)]) == 0
    # CPU timings of eager modes were marked as misses of goals stated for a GPU.
    proc = goals(cpu)
    assert proc.returncode != 0 and "measured on 'cpu'" in proc.stderr and "✗" not in proc.stdout
    # A GPU run of some cases and modes: the goals it cannot give are dashes, not a traceback.
    run = json.loads((root / "benchmarks" / "h200-2026-12-01-full-56.json").read_text())
    run["results"] = [r for r in run["results"] if r["case"] == "tiny8"]
    run["results"][0]["modes"] = {k: v for k, v in run["results"][0]["modes"].items() if k.startswith("eager")}
    gpu = tmp_path / "h200-some.json"
    gpu.write_text(json.dumps(run))
    proc = goals(gpu)
    assert proc.returncode == 0, proc.stderr
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in proc.stdout.splitlines()[2:-1]]
    rows = {goal: figure for _, goal, figure in cells}
    assert rows["fork/join per side branch, N = 8 [≤ 10 µs]"].split()[1] == "µs"  # (a figure)
    assert rows["mlp8 graphed vs eager seq [≥ 15×]"] == "–"


def test_bench_help_gives_defaults_and_repeatable_options():
    # What --help says is all a user of the command sees: an option taken several times
    # (action="append") says so, and one with a default names it.
    from parallel_modules.bench import _parser

    for action in _parser()._actions:
        if action.help is argparse.SUPPRESS or action.dest == "help":
            continue
        if isinstance(action, argparse._AppendAction):
            assert "repeatable" in action.help, f"{action.option_strings[0]}: {action.help!r} does not say it repeats"
        if action.default not in (None, False):
            assert f"default {action.default}" in action.help, (
                f"{action.option_strings[0]}: {action.help!r} does not give its default, {action.default!r}")
