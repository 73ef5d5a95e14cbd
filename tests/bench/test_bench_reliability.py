"""The reliability and soak suites, run small against real `leapfrog serve` processes: their
reports add up and say what happened (the full runs are benchmarks, in the README)."""
from __future__ import annotations

import json

import pytest

from leapfrog.bench.cli import main


def test_overload_and_recovery_parts(tmp_path):
    assert main(["--suite", "reliability", "--parts", "overload", "recovery", "--burst-factor", "3",
                 "--capacity", "2", "2", "--new-tokens", "8", "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "reliability.json").read_text())
    o = r["overload"]
    assert o["burst"] == 12 and o["admitted"] + o["rejected_429"] + o["other"] == 12
    assert o["admitted"] >= 4 and o["admitted_finished"] == o["admitted"] and o["rejected_429"] >= 1
    assert o["retry_after_on_all_429"] and o["other"] == 0 and o["server_5xx"] == 0
    assert o["kv_used_after"] == 0 and o["served_after"] and o["server_exit"] == 0
    rec = r["recovery"]
    served = {row["model"] for row in rec["rows"]}           # every default model, crashed 3 times
    assert {"stories", "couplets"} <= served and len(rec["rows"]) == 3 * len(served)
    assert rec["restarts_counted"] == len(rec["rows"]) and rec["hung"] == 0
    # a server that answers again (a restart that never comes back reads as inf); how fast is the
    # benchmark's figure, not a test's: reloading smollm2 swings with the machine
    assert rec["max_recovery_s"] < float("inf")
    for row in rec["rows"]:        # every request in flight ended: finished, or told why not
        assert sum(row["in_flight_outcomes"].values()) == row["in_flight"]
    table = (tmp_path / "reliability.md").read_text()
    assert "overload burst" in table and "engine crash" in table and (tmp_path / "reliability.png").is_file()


def test_soak_classifies_every_outcome(tmp_path):
    assert main(["--suite", "soak", "--duration", "12", "--warmup", "4", "--clients", "3", "--sample-interval", "2",
                 "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "soak.json").read_text())
    assert r["requests"] == sum(r["outcomes"].values()) > 10
    assert r["unexpected"] == 0, r["unexpected_examples"]
    assert r["server_5xx"] == 0 and r["kv_used_idle"] == 0 and r["server_exit"] == 0
    assert len(r["samples"]) >= 3 and all(s["rss_mb"] > 0 for s in r["samples"])
    assert any(k.startswith("bad: 4") for k in r["outcomes"])
    assert "resident memory" in (tmp_path / "soak.md").read_text()


@pytest.mark.parametrize("suite", ["reliability", "soak"])
def test_suites_are_listed(suite, capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert suite in capsys.readouterr().out


def test_warm_up_ends_when_memory_settles():
    from leapfrog.bench.soak import settled
    rss = [500, 560, 600, 640, 700, 705, 706, 707, 720, 721]        # one sample a minute
    samples = [{"t": 60.0 * i, "rss_mb": v} for i, v in enumerate(rss)]
    assert settled(samples, 60.0) == 300.0         # 705 is within 1% of 700, a minute before
    assert settled(samples, 420.0) == 420.0
    assert settled(samples[:3], 60.0) == 60.0      # never settles: the floor


def test_the_fuzz_summary_is_read_in_either_number():
    from leapfrog.bench.reliability import fuzz_counts
    assert fuzz_counts("Test cases:\n  2221 generated, 1 found 1 unique failure\n", 1) == (2221, 1)
    assert fuzz_counts("  3201 generated, 7 found 3 unique failures\n", 1) == (3201, 3)
    assert fuzz_counts("  500 generated, 0 found 0 unique failures\n", 0) == (500, 0)
    assert fuzz_counts("crashed before its summary", 2) == (0, -1)


def test_a_benchmarks_server_keeps_its_files_out_of_the_users_store(tmp_path, monkeypatch):
    """The fuzzer uploads files: a bench server gets a batch store of its own, removed when it
    stops (the user's default store once filled up to max_files that way)."""
    from pathlib import Path

    from leapfrog.bench import reliability

    started = []

    class FakeProcess:
        returncode = 0

        def __init__(self, cmd, **kw):
            started.append(cmd)

        def send_signal(self, sig):
            pass

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(reliability.subprocess, "Popen", FakeProcess)
    server = reliability.Server(["--model", "stories"], tmp_path / "s.log")
    cmd = started[0]
    store = Path(cmd[cmd.index("--batch-dir") + 1])
    assert store.is_dir() and "--batch-dir" not in server.command
    server.stop()
    assert not store.exists()
    own = reliability.Server(["--batch-dir", str(tmp_path / "mine")], tmp_path / "t.log")
    assert started[1].count("--batch-dir") == 1 and own.batch_dir is None
