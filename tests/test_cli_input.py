"""What a new user types (issue 10): every value gets a one-line error or a documented cap, and
the streamed text equals the `--json` text. Most cases run the CLI on the bundled pair."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tandem
from tandem.cli import build_parser, main
from tandem.config import MAX_DRAFT_TOKENS, MAX_WIDTH, ConfigError, GenerationConfig, SamplingConfig, SpecConfig
from tandem.runtime.pair import load_pair
from tandem.runtime.streaming import StopStreamer

REPO = Path(__file__).resolve().parents[1]


def run_cli(args, capsys):
    capsys.readouterr()
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def bad(capsys, args, needle):
    code, out, err = run_cli(args, capsys)
    line = err.strip()
    assert code == 2, (code, err)
    assert "\n" not in line and "Traceback" not in line, line
    assert line.startswith("tandem: error:") and needle in line, line
    return line


@pytest.fixture(scope="module")
def tokenizer():
    return load_pair(need_draft=False).tokenizer


# ---- 1. streamed --stop ------------------------------------------------------------------------
def _pieces_decoder(pieces: list[str]):
    """A decoder over a made-up vocabulary: token i is pieces[i]."""
    return lambda ids: "".join(pieces[i] for i in ids)


def test_stop_streamer_holds_back_a_stop_string_that_is_still_arriving():
    pieces = ["abc ", "re", "tu", "rn x", "red"]
    s = StopStreamer(_pieces_decoder(pieces), ["return"])
    assert s.push([0]) == "abc "
    assert s.push([1]) == ""  # "re" may start "return"
    assert s.push([2]) == ""  # "retu" too
    assert s.push([3]) == ""  # the stop string is complete: nothing of it is printed
    assert s.stopped and s.printed == "abc "
    assert s.push([0]) == ""  # after the stop, nothing more
    assert s.finish("abc ") == ""
    # a held prefix that turns out not to be the stop string is released
    s = StopStreamer(_pieces_decoder(pieces), ["return"])
    assert s.push([0, 1]) == "abc "
    assert s.push([4]) == "rered"


def test_stop_streamer_cuts_at_the_earliest_stop_and_holds_split_characters():
    s = StopStreamer(_pieces_decoder(["x = 1", "\n", "# done", "\ufffd", "é"]), ["# do", "\n"])
    assert s.push([0]) == "x = 1"
    assert s.push([1, 2]) == ""  # "\n" comes first, so the cut is there
    assert s.printed == "x = 1"
    s = StopStreamer(lambda ids: bytes(ids).decode("utf-8", errors="replace"))  # token = one byte
    assert s.push(list(b"ab\xc3")) == "ab"  # the first byte of "é" decodes as U+FFFD: held back
    assert s.push([0xA9]) == "é"
    with pytest.raises(ValueError):
        StopStreamer(_pieces_decoder([]), [""])


def test_stop_streamer_stream_equals_the_cut_text_for_every_token_split(tokenizer):
    text = "def f(x):\n    return x + 1\n\n\ndef g(y):\n    return y * 2\n"
    ids = tokenizer.encode(text).ids
    full = tokenizer.decode(ids)
    for stop in (["return"], ["y *", "\n\n"], ["zzz"], ["1\n"], ["f(", "def"]):
        hits = [full.find(s) for s in stop if s in full]
        want = full[: min(hits)] if hits else full
        for step in (1, 2, 3, 7):
            s = StopStreamer(tokenizer.decode, stop)
            streamed = "".join(s.push(ids[i:i + step]) for i in range(0, len(ids), step))
            assert want.startswith(streamed)
            assert streamed + s.finish(want) == want, (stop, step)


def test_streamed_stop_output_equals_the_json_text(capsys):
    args = ["generate", "def f():", "--max-new-tokens", "30", "--stop", "return"]
    code, out_json, _ = run_cli(args + ["--json"], capsys)
    assert code == 0
    rec = json.loads(out_json)
    assert rec["finish_reason"] == "stop" and "return" not in rec["text"]
    code, out, err = run_cli(args, capsys)
    assert code == 0, err
    assert out == rec["text"] + "\n"


# ---- 2, 8. caps on N, k, w, d -------------------------------------------------------------------
def test_spec_caps_follow_the_context_window():
    spec, notes = SpecConfig(nodes=100000, k=1000, width=1000, depth=100000).capped(512)
    assert (spec.nodes, spec.k, spec.width, spec.depth) == (511, 511, MAX_WIDTH, 511 // MAX_WIDTH)
    assert [n.split()[0] for n in notes] == ["--nodes", "--k", "--width", "--depth"]
    assert "--nodes 100000 capped to 511" in notes[0]
    big, _ = SpecConfig(nodes=100000, k=100000).capped(131072)
    assert big.nodes == big.k == MAX_DRAFT_TOKENS
    same, notes = SpecConfig().capped(512)
    assert same == SpecConfig() and notes == []


def test_async_with_a_huge_node_budget_is_capped_and_runs(capsys):
    code, out, err = run_cli(["generate", "def f():", "--method", "async", "--nodes", "100000", "--width", "1000",
                              "--max-new-tokens", "4", "--ignore-eos", "--json"], capsys)
    assert code == 0, err
    assert "tandem: note: --nodes 100000 capped to 511" in err
    assert f"tandem: note: --width 1000 capped to {MAX_WIDTH}" in err
    rec = json.loads(out)
    code, out_ar, _ = run_cli(["generate", "def f():", "--method", "ar", "--max-new-tokens", "4", "--ignore-eos",
                               "--json"], capsys)
    assert rec["token_ids"] == json.loads(out_ar)["token_ids"]


def test_chain_k_and_tree_depth_are_capped_with_a_notice(capsys):
    code, out, err = run_cli(["generate", "def f():", "--method", "chain", "--k", "1000", "--max-new-tokens", "3",
                              "--ignore-eos", "--json"], capsys)
    assert code == 0 and "tandem: note: --k 1000 capped to 511" in err
    code, out, err = run_cli(["generate", "def f():", "--method", "tree", "--depth", "100000", "--max-new-tokens",
                              "3", "--ignore-eos", "--json"], capsys)
    assert code == 0 and "tandem: note: --depth 100000 capped to 127" in err


# ---- 9. --max-new-tokens beyond the context --------------------------------------------------------
def test_max_new_tokens_beyond_the_context_gets_a_notice(tokenizer, capsys):
    line = "x = 1\n"
    n = 1
    while len(tokenizer.encode(line * (n + 1)).ids) <= 505:
        n += 1
    prompt = line * n
    room = 512 - len(tokenizer.encode(prompt).ids)
    code, out, err = run_cli(["generate", prompt, "--method", "ar", "--max-new-tokens", "100000", "--ignore-eos",
                              "--json"], capsys)
    assert code == 0, err
    assert f"tandem: note: --max-new-tokens 100000 capped to {room}" in err
    rec = json.loads(out)
    assert rec["new_tokens"] == room and rec["finish_reason"] == "length"


# ---- 3. --out checked before any work ---------------------------------------------------------------
def test_bench_audit_profile_refuse_an_out_that_is_a_file(tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.write_text("keep me")
    work = tmp_path / "w.jsonl"
    work.write_text(json.dumps({"prompt": "def f():"}) + "\n")
    t0 = time.perf_counter()
    bad(capsys, ["bench", "--workload", str(work), "--methods", "ar", "--max-new-tokens", "2", "--warmup", "0",
                 "--no-plots", "--out", str(taken)], "is an existing file")
    bad(capsys, ["audit", "--workload", str(work), "--max-new-tokens", "2", "--out", str(taken)], "is an existing file")
    bad(capsys, ["profile", "--preset", "tiny", "--out", str(taken)], "is an existing file")
    assert time.perf_counter() - t0 < 20  # refused before loading anything
    assert taken.read_text() == "keep me"


def test_bench_flags_checked_up_front(tmp_path, capsys):
    work = tmp_path / "w.jsonl"
    work.write_text(json.dumps({"prompt": "def f():"}) + "\n")
    base = ["bench", "--workload", str(work), "--methods", "ar", "--out", str(tmp_path / "o")]
    bad(capsys, base + ["--bootstrap", "0"], "--bootstrap must be in [1, ")
    bad(capsys, base + ["--bootstrap", "1000000000"], "--bootstrap must be in [1, ")
    bad(capsys, base + ["--async-transport", "pigeon"], "unknown --async-transport")
    bad(capsys, ["audit", "--workload", str(work), "--rate-tolerance", "nan", "--out", str(tmp_path / "a")],
        "--rate-tolerance must be a finite number")


# ---- 4, 10. the prompt --------------------------------------------------------------------------------
def test_prompt_file_must_be_utf8_text_and_not_given_twice(tmp_path, capsys):
    latin1 = tmp_path / "latin1.py"
    latin1.write_bytes("print('café')\n".encode("latin-1"))
    bad(capsys, ["generate", "--prompt-file", str(latin1), "--method", "ar"], "is not UTF-8 text (byte 0xe9")
    binary = tmp_path / "blob.bin"
    binary.write_bytes(b"\x00\x01\x02abc")
    bad(capsys, ["generate", "--prompt-file", str(binary), "--method", "ar"], "holds NUL bytes")
    ok = tmp_path / "ok.py"
    ok.write_text("def f():")
    bad(capsys, ["generate", "def g():", "--prompt-file", str(ok), "--method", "ar"], "not both")


# ---- 6, 7, 10. sampling and generation flags ----------------------------------------------------------
def test_any_integer_seed_is_taken_modulo_2_64(capsys):
    assert SamplingConfig(seed=-1).seed == 2**64 - 1 and SamplingConfig(seed=2**70 + 5).seed == 5
    base = ["generate", "import os", "--method", "ar", "--temperature", "0.9", "--max-new-tokens", "6",
            "--ignore-eos", "--json"]
    huge = 1180591620717411303424
    code, out_huge, err = run_cli(base + ["--seed", str(huge)], capsys)
    assert code == 0, err
    code, out_small, _ = run_cli(base + ["--seed", str(huge % 2**64)], capsys)
    assert json.loads(out_huge)["token_ids"] == json.loads(out_small)["token_ids"]


def test_a_sampled_generate_without_a_seed_draws_one_and_prints_it(capsys):
    """vLLM's and transformers' habit: sampling without a seed differs from run to run. The seed
    drawn is printed, and passing it repeats the output."""
    import re

    base = ["generate", "import os", "--method", "ar", "--temperature", "2.0", "--max-new-tokens", "6",
            "--ignore-eos"]
    runs = []
    for _ in range(3):
        code, out, err = run_cli(base + ["--json"], capsys)
        assert code == 0, err
        runs.append((json.loads(out)["seed"], json.loads(out)["token_ids"]))
    assert len({seed for seed, _ in runs}) == 3
    code, out, err = run_cli(base + ["--json", "--seed", str(runs[0][0])], capsys)
    assert json.loads(out)["token_ids"] == runs[0][1] and json.loads(out)["seed"] == runs[0][0]
    code, out, err = run_cli(base, capsys)  # streamed text: the seed in the summary line
    seed = int(re.search(r", seed (\d+) \(--seed \1 repeats it\)\]", err).group(1))
    code, again, _ = run_cli(base + ["--seed", str(seed)], capsys)
    assert again == out
    code, out, err = run_cli(["generate", "import os", "--method", "ar", "--max-new-tokens", "2", "--json"], capsys)
    assert code == 0 and "seed" not in err and "seed" not in json.loads(out)  # (greedy: no seed to speak of)


@pytest.mark.parametrize("flags, needle", [
    (["--method", "ar", "--stop", ""], "--stop needs a non-empty string"),
    (["--method", "ar", "--temperature", "inf"], "--temperature must be a finite number >= 0 (got inf)"),
    (["--method", "async", "--split-search", "0"], "--split-search K needs K >= 2"),
    (["--method", "tree", "--split-search", "2"], "work with --method async"),
    (["--method", "tree", "--transport", "gloo"], "--transport works with --method async"),
    # a draft-shape flag the method does not read
    (["--method", "ar", "--k", "5"], "--k is not read by --method ar; drop it"),
    (["--method", "chain", "--nodes", "8"], "--nodes is not read by --method chain (it reads --k)"),
    (["--method", "tree", "--k", "3"], "--k is not read by --method tree (it reads --nodes, --width, --depth)"),
    (["--method", "async", "--k", "3"], "--k is not read by --method async"),
    (["--method", "tlv", "--depth", "3"], "--depth is not read by --method tlv (it reads --nodes, --width)"),
    # async and tlv run a draft model: refused before the drafter loads
    (["--method", "async", "--draft", "block"], "--method async runs a draft model; a block drafter already"),
    (["--method", "tlv", "--draft", "eagle3"], "--method tlv runs a draft model; an EAGLE-3 head drafts from"),
])
def test_small_flag_mistakes_get_one_line_errors(flags, needle, capsys):
    bad(capsys, ["generate", "x", "--max-new-tokens", "2", *flags], needle)


@pytest.mark.parametrize("args, needle", [
    (["generate", "x", "--method", "bogus"], "argument --method: invalid choice: 'bogus'"),
    (["generate", "x", "--max-new-tokens", "abc"], "argument --max-new-tokens: invalid int value: 'abc'"),
    (["bench", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    (["nonsense"], "argument command: invalid choice: 'nonsense'"),
    (["train-drafters", "--out", "d", "--compile", "maybe"], "argument --compile: invalid choice: 'maybe'"),
])
def test_argument_parsing_errors_are_one_line(args, needle, capsys):
    with pytest.raises(SystemExit) as e:
        main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("tandem: error: ") and needle in err, err
    assert "usage:" not in err and "--help" in err


def test_async_and_tlv_refuse_a_feature_drafter_already_loaded_and_audit_before_loading(capsys, monkeypatch):
    from tandem.runtime import pair as pair_mod
    from tandem.runtime.generate import Generator

    pair = load_pair(None, "eagle3")
    for method in ("async", "tlv"):
        with pytest.raises(ConfigError, match=f"--method {method} runs a draft model; an EAGLE-3 head"):
            Generator(pair.target, pair.draft, pair.tokenizer).generate([1, 2], method)
    monkeypatch.setattr(pair_mod, "load_model", lambda *a, **k: pytest.fail("loaded weights before refusing"))
    bad(capsys, ["audit", "--method", "async", "--draft", "block", "--workload", "source", "--num-prompts", "1"],
        "--method async runs a draft model; a block drafter")


def test_a_draft_with_ar_is_noted_and_not_loaded(capsys, monkeypatch):
    from tandem.runtime import pair as pair_mod

    seen = []
    real = pair_mod.load_pair
    monkeypatch.setattr(pair_mod, "load_pair", lambda target, draft, *a, **k: seen.append(draft) or real(target, draft, *a, **k))
    code, out, err = run_cli(["generate", "x", "--method", "ar", "--draft", "block", "--max-new-tokens", "2", "--json"],
                             capsys)
    assert code == 0 and seen == [None], (code, err)
    assert "tandem: note: --draft block is not used by --method ar (plain decoding drafts nothing); not loaded" in err


def test_a_reader_that_leaves_the_pipe_stops_generate_quietly():
    """`tandem generate ... | head -c 5`: no error line, no traceback, the shell's status for a closed pipe."""
    proc = subprocess.Popen([sys.executable, "-m", "tandem", "generate", "def fib(n):", "--method", "ar",
                             "--max-new-tokens", "200", "--ignore-eos"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=REPO)
    assert proc.stdout.read(5)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert "error" not in err and "Traceback" not in err, err


def test_the_api_names_import_lazily_from_the_package():
    """`import tandem` (the CLI's --version and --help) imports no torch; the API's names come on first use."""
    code = ("import sys, tandem; assert 'torch' not in sys.modules; "
            "from tandem import LLM, SamplingParams, SpecConfig, EngineConfig; from tandem.engine import Engine; "
            "assert Engine.__module__ == 'tandem.engine.engine' and SpecConfig.__module__ == 'tandem.config'; "
            "print(sorted(n for n in dir(tandem) if n in tandem.__all__))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['EngineConfig', 'LLM', 'SamplingParams', 'SpecConfig', '__version__']"


def test_empty_stop_string_refused_by_the_config():
    with pytest.raises(ValueError, match="non-empty"):
        GenerationConfig(stop=("",)).validate()


def test_a_draft_with_a_larger_vocabulary_than_the_target_is_refused(tiny_checkpoint, capsys):
    """Same tokenizer, a padded draft embedding: it could draft ids the target has no row for."""
    t = tiny_checkpoint("llama", name="t")
    d = tiny_checkpoint("llama", name="d", vocab_size=384)
    bad(capsys, ["generate", "x", "--target", str(t), "--draft", str(d), "--method", "tree"],
        f"draft {str(d)!r} has vocab_size 384, more than the target's 320")
    code, _, err = run_cli(["generate", "x", "--target", str(d), "--draft", str(t), "--method", "tree",
                            "--max-new-tokens", "4"], capsys)
    assert code == 0, err  # (a target with the larger vocabulary verifies any draft id)


def test_shape_mismatch_names_the_checkpoint(tiny_checkpoint, tmp_path, capsys):
    import shutil

    t = tiny_checkpoint("llama", name="t")
    d = tmp_path / "d"
    shutil.copytree(t, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] += 8
    (d / "config.json").write_text(json.dumps(cfg))
    line = bad(capsys, ["generate", "x", "--target", str(t), "--draft", str(d), "--method", "tree"], "has shape")
    assert line.startswith(f"tandem: error: draft checkpoint {str(d)!r}:"), line
    line = bad(capsys, ["generate", "x", "--target", str(d), "--method", "ar"], "has shape")
    assert line.startswith("tandem: error: target checkpoint"), line


def test_help_and_version(capsys):
    sub = build_parser()._subparsers._group_actions[0].choices["generate"]
    draft_help = next(a.help for a in sub._actions if "--draft" in a.option_strings)
    assert "default without --target: the bundled draft model" in draft_help
    assert "on cuda with auto, chain or tree: the bundled eagle3 head" in draft_help
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out.strip()
    assert re.fullmatch(r"tandem \d+\.\d+\.\d+\S*", out), out
    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'version = "{tandem.__version__}"' in pyproject


# ---- 5. Ctrl-C while the async gloo workers start ----------------------------------------------------
def _children(pid: int) -> list[int]:
    kids = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            kids += [int(x) for x in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
        except OSError:
            pass
    return kids


def _is_spawned_worker(pid: int) -> bool:
    try:
        return b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _terminal_signals() -> None:
    """In the child, before exec: SIGINT as a shell hands it to a command it starts (default
    action, not blocked). A process inherits an ignored or blocked SIGINT, and Python then leaves
    it so: in the full suite this test's `tandem` ran to the end, exit 0, through its Ctrl-C
    (seen on the 2-core development machine in every full run of 2026-12-03, never alone)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@pytest.mark.skipif(not Path("/proc/self/task").is_dir() or sys.platform != "linux", reason="needs Linux /proc")
def test_ctrl_c_while_gloo_workers_start_is_one_line_and_leaves_no_worker():
    # NOTE: a terminal's Ctrl-C goes to the whole process group; it is sent the moment a worker
    # exists, while the worker is still importing torch (it ignores SIGINT only once its main runs)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.Popen([sys.executable, "-m", "tandem", "generate", "def f():", "--method", "async",
                          "--transport", "gloo", "--max-new-tokens", "8"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True, env=env,
                         preexec_fn=_terminal_signals)
    try:
        workers: list[int] = []
        deadline = time.monotonic() + 90
        while not workers and p.poll() is None and time.monotonic() < deadline:
            workers = [k for k in _children(p.pid) if _is_spawned_worker(k)]
            time.sleep(0.01)
        assert workers, "no worker process was spawned"
        os.killpg(p.pid, signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 130, err
    assert err.strip() == "tandem: interrupted", err
    time.sleep(0.5)
    left = [w for w in workers if Path(f"/proc/{w}").exists()
            and Path(f"/proc/{w}/stat").read_text().split()[2] != "Z"]
    assert not left


# ---- the sweep: the other subcommands -----------------------------------------------------------
def test_generate_refuses_bad_worker_counts(capsys):
    bad(capsys, ["generate", "x", "--method", "async", "--transport", "gloo", "--tensor-parallel-size", "0"],
        "must be >= 1 (got 0, 1)")
    bad(capsys, ["generate", "x", "--method", "async", "--transport", "gloo", "--tensor-parallel-size", "100000"],
        "worker processes asked for")
    bad(capsys, ["generate", "x", "--method", "async", "--transport", "gloo", "--split-search", "100000"],
        "worker processes asked for")


def test_profile_flags_checked(tmp_path, capsys):
    out = str(tmp_path / "p")
    bad(capsys, ["profile", "--preset", "tiny", "--width", "0", "--out", out], "--width must be >= 1")
    bad(capsys, ["profile", "--preset", "tiny", "--measure-tau", "--tau-prompts", "0", "--out", out],
        "--tau-prompts must be >= 1")


def test_any_integer_seed_for_profile_and_train_pair():
    parser = build_parser()
    assert parser.parse_args(["profile", "--seed", str(2**64 + 3)]).seed == 3
    assert parser.parse_args(["profile", "--seed", "-1"]).seed == 2**63 - 1
    assert parser.parse_args(["train-pair", "--out", "x", "--seed", "-1"]).seed == 2**32 - 1


def test_an_unwritable_train_pair_out_is_one_line(tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.write_text("keep me")
    for cmd in (["train-pair", "--tiny"], ["train-drafters", "--tiny", "--kind", "block"]):
        bad(capsys, [*cmd, "--out", str(taken)], f"--out {str(taken)!r} is an existing file; give a folder")
    assert taken.read_text() == "keep me"


def test_a_negative_position_decay_is_refused_in_one_line(tmp_path, capsys):
    bad(capsys, ["train-drafters", "--tiny", "--kind", "block", "--position-decay", "-1", "--out", str(tmp_path / "d")],
        "--position-decay must be >= 0")
    assert not (tmp_path / "d" / "block").exists()
