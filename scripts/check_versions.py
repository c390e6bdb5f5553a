"""megatron-core and Megatron-LM versions from source snapshots: the patch checks and a subset of
the project's Megatron tests against each (issue 63).

    python scripts/check_versions.py [--skip-installed] [--timeout 900] [--json OUT.json]
        [--logs DIR] [--tests T ... --] SNAPSHOT...

A SNAPSHOT is a ``core_vX.Y.Z.tar.gz`` of a Megatron-LM tag (its ``megatron/`` with megatron-core,
as ../shared/megatron-lm holds them). For each one:

  patches  tests/test_megatron_lm_patch.py for that tag, with this Python (static checks: the
           tag's patch applies and its hunks land in the right functions, the launcher's targets
           exist);
  tests    the Megatron tests of ``--tests`` (default: :data:`SUBSET`) with the tag's megatron-core
           source imported instead of the installed one.

How the source is imported: megatron-core 0.17-0.19 declare Python >= 3.12 and no wheel of them
exists for this Python, but their source imports on 3.11. Each version gets a throwaway virtual
environment of this Python's base interpreter whose site-packages holds ``.pth`` files: the
unpacked tag first on ``sys.path`` (ahead of every site-packages, as PYTHONPATH would put it, but
also in the processes the tests start with a PYTHONPATH of their own), then a cached environment
(``.venv-versions/megatron-core``, made once) that adds triton (megatron-core imports it from 0.18
on without declaring it; installed there with pip, from the local mirror where there is one) and
chains to this environment's site-packages (torch, DeepSpeed, AdaCheck, pytest). On Python < 3.12
the harness also gives ``typing`` an identity ``override`` (Megatron-LM 0.19's megatron.training
uses it); the product never does. Each run checks first that ``megatron.core`` comes from the tag.

``--skip-installed``: a snapshot of the installed megatron-core version gets its patch checks only
(the main suite ran the tests on it). Prints a table (version, how, passed / failed / skipped of
each part) and writes it as JSON with ``--json``. Exit status 0 when nothing failed, 1 otherwise,
2 for a usage error. Nothing is fetched at run time except triton, once, by pip.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from adacheck_megatron import package_info_version  # noqa: E402

# The Megatron tests run against each version, chosen for what moved in megatron-core 0.17-0.19:
#   - conversion to and from torch_dist with megatron-core's own dist_checkpointing save and load
#     (0.19: strategies.base gone, other strategies replaced, the common state a ShardedObject),
#     plain and distributed optimizer ('fully_reshardable'), TP=2 -> PP=2, AdaCheck's own save and
#     load of the sharded state dicts around it; sharded objects without the common state;
#   - exact resume with dropout: every RNG state, the model-parallel tracker's too;
#   - MoE at expert parallelism 2 with the distributed optimizer: its buffers, expert and dense
#     grids, online deltas replayed on half the data-parallel ranks.
SUBSET = (
    "tests/test_megatron.py::test_torch_dist_conversion_both_ways",
    "tests/test_megatron.py::"
    "test_torch_dist_sharded_objects_are_converted_without_the_common_state",
    "tests/test_megatron_integrity.py::test_resume_with_dropout_restores_every_rng_state",
    "tests/test_megatron_online.py::"
    "test_expert_parallel_deltas_replay_on_fewer_data_parallel_ranks[ep2]",
)
TRITON = os.environ.get("ADACHECK_TRITON", "triton==3.8.0")   # the one torch 2.14 pins
TAG = re.compile(r"^(core_v\d+\.\d+\.\d+\w*)\.tar\.gz$")


def site_packages(venv: str) -> str:
    return sysconfig.get_path("purelib", vars={"base": venv, "platbase": venv})


def base_python() -> str:
    return getattr(sys, "_base_executable", None) or sys.executable


def cached_env(cache: str, log) -> str:
    """The environment with triton that each version's chains to (made once); its site-packages."""
    venv = os.path.join(cache, "megatron-core")
    python = os.path.join(venv, "bin", "python")
    if not os.path.isfile(os.path.join(venv, ".ready")):
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([base_python(), "-m", "venv", venv], check=True, timeout=600)
        with open(os.path.join(site_packages(venv), "zz_adacheck_base.pth"), "w") as f:
            f.write(f"import site; site.addsitedir({sysconfig.get_path('purelib')!r})\n")
        p = subprocess.run([python, "-m", "pip", "install", "-q", TRITON], capture_output=True,
                           text=True, timeout=1800)
        log.write(f"$ pip install {TRITON}\n{p.stdout}{p.stderr}\n")
        if p.returncode != 0:
            raise SystemExit(f"check_versions: pip could not install {TRITON} into {venv} "
                             f"(megatron-core imports triton from 0.18 on):\n{p.stderr[-2000:]}")
        open(os.path.join(venv, ".ready"), "w").close()
    return site_packages(venv)


def version_env(tree: str, cached_site: str, where: str) -> str:
    """A throwaway environment whose Python imports megatron from ``tree`` first; its python."""
    subprocess.run([base_python(), "-m", "venv", "--without-pip", where], check=True, timeout=300)
    site = site_packages(where)
    with open(os.path.join(site, "aa_megatron_tree.pth"), "w") as f:
        f.write(tree + "\n")
    if sys.version_info < (3, 12):   # Megatron-LM 0.19's megatron.training: typing.override
        with open(os.path.join(site, "ab_typing_override.pth"), "w") as f:
            f.write("import typing; hasattr(typing, 'override') or "
                    "setattr(typing, 'override', lambda f: f)\n")
    with open(os.path.join(site, "zz_cached.pth"), "w") as f:
        f.write(f"import site; site.addsitedir({cached_site!r})\n")
    return os.path.join(where, "bin", "python")


def junit_counts(path: str) -> dict:
    """passed / failed / skipped (errors count as failed), the failed tests' names and each
    test's seconds."""
    if not os.path.isfile(path):
        return {"passed": 0, "failed": 0, "skipped": 0, "failures": ["(no report: see the log)"]}
    counts = {"passed": 0, "failed": 0, "skipped": 0, "failures": [], "durations": {}}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        counts["durations"][name] = round(float(case.get("time") or 0), 1)
        if case.find("failure") is not None or case.find("error") is not None:
            counts["failed"] += 1
            counts["failures"].append(name)
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts


def pytest(python: str, tests, env: dict, report: str, log_path: str, timeout: float) -> dict:
    """One pytest run (its own process group, killed whole past ``timeout``), counted from its
    junit report."""
    base = os.path.splitext(report)[0] + "-tmp"
    cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", f"--junitxml={report}",
           f"--basetemp={base}", *tests]
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = "timeout"
        finally:
            try:   # the ranks and servers the tests started, too
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
    shutil.rmtree(base, ignore_errors=True)
    out = junit_counts(report)
    if rc == "timeout" or (rc not in (0, 1, 5) and not out["failed"]):
        out["failed"] += 1
        out["failures"].append(f"pytest exit {rc} (see {log_path})")
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def check(snapshot: str, args, work: str, cached_site, installed: str, log) -> dict:
    name = os.path.basename(snapshot)
    tag = TAG.match(name)[1]
    row = {"snapshot": os.path.abspath(snapshot), "tag": tag}
    tree = os.path.join(work, tag, "src")
    os.makedirs(tree)
    with tarfile.open(snapshot) as tar:
        tar.extractall(tree, filter="data")
    row["megatron_core"] = version = package_info_version(os.path.join(tree, "megatron"))
    if version is None:
        raise SystemExit(f"check_versions: {snapshot} holds no megatron/core/package_info.py")
    logs = os.path.join(args.logs, tag)
    os.makedirs(logs, exist_ok=True)

    # the patch checks, against a folder that holds this snapshot only
    shared = os.path.join(work, tag, "shared")
    os.makedirs(shared)
    os.symlink(os.path.abspath(snapshot), os.path.join(shared, name))
    env = dict(os.environ, ADACHECK_MEGATRON_LM_SNAPSHOTS=shared)
    row["patches"] = pytest(sys.executable, ["tests/test_megatron_lm_patch.py", "-k",
                                             f"{tag} or every_snapshot"], env,
                            os.path.join(logs, "patches.xml"), os.path.join(logs, "patches.log"),
                            args.timeout)

    if args.skip_installed and version == installed:
        row["how"] = f"megatron-core {installed} installed: its tests are the main suite's"
        row["tests"] = None
        return row
    python = version_env(tree, cached_site(), os.path.join(work, tag, "venv"))
    env = dict(os.environ, NO_VCS_VERSION="1", PYTHONDONTWRITEBYTECODE="1")
    env.pop("PYTHONPATH", None)
    p = subprocess.run([python, "-c", "import sys, megatron.core as m; print(m.__file__); "
                        "print(sys.version.split()[0])"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    log.write(f"[{tag}] import megatron.core: {p.stdout}{p.stderr[-3000:]}\n")
    imported = p.stdout.split("\n")[0] if p.returncode == 0 else ""
    if not imported.startswith(tree + os.sep):
        row["how"] = "source on sys.path"
        row["tests"] = {"passed": 0, "failed": 1, "skipped": 0, "seconds": 0,
                        "failures": [f"import megatron.core gave {imported or p.stderr[-500:]!r}, "
                                     f"not the tag's {tree}"]}
        return row
    row["how"] = (f"source on sys.path (.pth), Python {p.stdout.split()[1]}, "
                  f"torch {torch_version()}, {TRITON}")
    row["tests"] = pytest(python, args.tests, env, os.path.join(logs, "tests.xml"),
                          os.path.join(logs, "tests.log"), args.timeout)
    return row


def torch_version() -> str:
    from importlib.metadata import version
    return version("torch")


def part(counts) -> str:
    if counts is None:
        return "-"
    return f"{counts['passed']}/{counts['failed']}/{counts['skipped']}"


def table(rows) -> str:
    lines = ["| version | tag | how | patches p/f/s | tests p/f/s | tests s |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        t = r["tests"]
        lines.append(f"| {r['megatron_core']} | {r['tag']} | {r['how']} | {part(r['patches'])} | "
                     f"{part(t)} | {t['seconds'] if t else '-'} |")
    for r in rows:
        for what in ("patches", "tests"):
            for f in (r[what] or {}).get("failures", []):
                lines.append(f"FAILED {r['tag']} {what}: {f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("snapshots", nargs="+", metavar="SNAPSHOT")
    ap.add_argument("--tests", nargs="+", default=list(SUBSET),
                    help="pytest node ids or files (default: the subset in SUBSET)")
    ap.add_argument("--skip-installed", action="store_true",
                    help="only the patch checks for the installed megatron-core's version")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per pytest run")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--logs", help="pytest logs and reports (default: a temporary folder, kept)")
    ap.add_argument("--cache", default=os.path.join(ROOT, ".venv-versions"),
                    help="where the environment with triton is kept between runs")
    args = ap.parse_args(argv)
    for s in args.snapshots:
        if not os.path.isfile(s):
            ap.error(f"{s}: no such snapshot")
        if not TAG.match(os.path.basename(s)):
            ap.error(f"{s}: expected a snapshot named core_vX.Y.Z.tar.gz")
    args.logs = os.path.abspath(args.logs or tempfile.mkdtemp(prefix="adacheck-versions-logs-"))
    os.makedirs(args.logs, exist_ok=True)
    try:
        from importlib.metadata import version
        installed = version("megatron-core")
    except Exception:
        installed = None
    site = []

    def cached_site():
        if not site:
            site.append(cached_env(args.cache, log))
        return site[0]

    rows = []
    t0 = time.perf_counter()
    with open(os.path.join(args.logs, "check_versions.log"), "w") as log, \
            tempfile.TemporaryDirectory(prefix="adacheck-versions-") as work:
        for s in args.snapshots:
            row = check(s, args, work, cached_site, installed, log)
            rows.append(row)
            print(f"[check_versions] {row['tag']}: patches {part(row['patches'])}, tests "
                  f"{part(row['tests'])} (passed/failed/skipped)", flush=True)
    print(table(rows))
    print(f"[check_versions] {time.perf_counter() - t0:.0f} s; logs in {args.logs}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    failed = any(r[w] and r[w]["failed"] for r in rows for w in ("patches", "tests"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
