"""benchmarks/child_rows.py, the one-process-per-program loop of the compile benchmarks (gpu/maxtext_step.py,
gpu/te_weight_gather.py, blackwell/recipes_compile.py), with a stand-in child script: rows read back from ``ROW``
lines among other output, failures and timeouts handed to the script's ``row_of``, the JSON files, stopping."""

import json
import os
import sys
import textwrap

import pytest

_BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")
sys.path.insert(0, _BENCH)

import child_rows  # noqa: E402  pylint: disable=wrong-import-position


@pytest.fixture(scope="module")
def script(tmp_path_factory):
  """A child that acts out its name: ``ok<N>`` prints noise and the row {"n": N}, ``fail`` raises, ``sleep`` sleeps,
  ``killed`` kills itself after printing noise."""
  path = tmp_path_factory.mktemp("child") / "child.py"
  path.write_text(textwrap.dedent(f"""
      import os, signal, sys, time
      sys.path.insert(0, {_BENCH!r})
      import child_rows
      name = sys.argv[2]
      assert sys.argv[1] == "--one"
      if name.startswith("ok"):
        print("ROWS are not rows; ROW without its space neither")
        child_rows.emit({{"name": name, "n": int(name[2:])}})
        print("after the row")
      elif name == "fail":
        print("some progress")
        raise ValueError("no such program: fail")
      elif name == "sleep":
        time.sleep(30)
      elif name == "killed":
        print("partial", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
      """))
  return str(path)


def _keep(name, run):
  return {"name": name, "row": run.row, "rc": run.returncode, "timed_out": run.timed_out,
          "last_err": run.stderr.strip().splitlines()[-1:], "wall_s": run.wall_s}


def test_rows_come_back_in_order_and_go_to_both_json_files(script, tmp_path, capsys):
  lines, listed = tmp_path / "rows.jsonl", tmp_path / "rows.json"
  lines.write_text('{"earlier": 1}\n')  # json_lines appends
  rows = child_rows.collect(script, ["ok3", "fail", "ok7"], lambda n: ["--one", n], _keep, json_lines=str(lines),
                            json_list=str(listed))
  assert [r["row"] for r in rows] == [{"name": "ok3", "n": 3}, None, {"name": "ok7", "n": 7}]
  assert [r["rc"] for r in rows] == [0, 1, 0]
  assert rows[1]["last_err"] == ["ValueError: no such program: fail"]
  assert not any(r["timed_out"] for r in rows)
  assert [json.loads(l) for l in lines.read_text().splitlines()] == [{"earlier": 1}, *rows]
  assert json.loads(listed.read_text()) == rows
  assert [json.loads(l) for l in capsys.readouterr().out.splitlines()] == rows  # echo: one JSON line per row


def test_killed_and_timed_out_children_and_stopping(script):
  rows = child_rows.collect(script, ["killed", "sleep"], lambda n: ["--one", n], _keep, timeout=2, echo=False)
  assert rows[0]["row"] is None and rows[0]["rc"] == -9 and not rows[0]["timed_out"]
  assert rows[1]["row"] is None and rows[1]["rc"] is None and rows[1]["timed_out"]
  assert 1.9 <= rows[1]["wall_s"] < 10  # the timeout, not the child's 30 s
  seen = []

  def stop_at_fail(name, run):
    seen.append(name)
    return None if run.row is None else run.row

  assert child_rows.collect(script, ["ok1", "fail", "ok2"], lambda n: ["--one", n], stop_at_fail, echo=False) is None
  assert seen == ["ok1", "fail"]

