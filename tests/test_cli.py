"""The ``adacheck`` command as a new user meets it: a path that is missing or a file is a one-line
error with exit status 2 (never a traceback, never exit 0), output piped into ``head`` stops
quietly, ``--version`` answers, ``inspect --json --tensors`` lists the tensors, and ``--help``
states the exit codes."""
import os
import subprocess
import sys

import pytest
import torch

from adacheck import __version__
from adacheck.checkpoint import Checkpointer, Options
from adacheck.integration import LocalShard, LocalState
from adacheck.cli import _size, main
from adacheck.plan.exchange import SoloComm
from adacheck.types import Box

pytestmark = pytest.mark.unit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = {f"master/w{i:04d}": (3, 1 + i % 5) for i in range(1500)}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("cli") / "ck")
    shards = [LocalShard(name, "master", shape, Box.full(shape), torch.full(shape, float(i)))
              for i, (name, shape) in enumerate(SHAPES.items())]
    Checkpointer(options=Options(fsync=False)).save(SoloComm(), root, "s1", lambda: LocalState(shards, step=1))
    return root


@pytest.mark.parametrize("argv, says", [
    (["ls", "{missing}"], "no such directory"),
    (["prune", "{missing}", "--keep-last", "1"], "no such directory"),
    (["inspect", "{missing}"], "no such directory"),
    (["verify", "{missing}"], "no such directory"),
    (["diff", "{ck}", "{missing}"], "no such directory"),
    (["ls", "{ck}/latest"], "is a file"),
    (["prune", "{ck}/latest", "--keep-last", "1"], "is a file"),
    (["inspect", "{ck}/s1/manifest.json"], "is a file"),
    (["verify", "{ck}/s1/manifest.json"], "is a file"),
    (["convert", "{ck}", "{missing}", "--config", "{missing}/config.json"], "--config"),
    (["convert", "{ck}", "{missing}", "--config", "{ck}"], "no such file in it: config.json"),
    (["convert", "{ck}", "{missing}", "--to", "deepspeed", "--config", "{ck}"], "apply to --to weights only"),
])
def test_a_missing_directory_or_a_file_is_a_clean_error(ckpt, tmp_path, capsys, argv, says):
    argv = [a.format(ck=ckpt, missing=str(tmp_path / "nowhere")) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and err.startswith(f"adacheck {argv[0]}: error:") and len(err.splitlines()) == 1, err


def test_output_into_a_closed_pipe_stops_quietly(ckpt):
    p = subprocess.Popen([sys.executable, "-m", "adacheck.cli", "inspect", ckpt, "--tensors"], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.stdout.readline().startswith(b"checkpoint")
    p.stdout.close()            # as `| head -1` does (the listing is far larger than a pipe's buffer)
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 0 and "Traceback" not in err, err


def test_version_json_tensors_and_exit_codes(ckpt, capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"adacheck {__version__}"
    import json
    assert main(["inspect", ckpt, "--json", "--tensors"]) == 0
    listed = json.loads(capsys.readouterr().out)["tensor_list"]
    assert {t["name"]: tuple(t["shape"]) for t in listed} == SHAPES
    assert all(t["bytes"] == 4 * t["shape"][0] * t["shape"][1] and t["dtype"] == "float32" for t in listed)
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "exit status: 0 ok; 1 damage found" in " ".join(capsys.readouterr().out.split())


def test_conversions_refuse_what_they_would_ignore_or_overwrite(ckpt, tmp_path, capsys):
    for argv, says in (([ckpt, f"{ckpt}/s1/weights"], "inside the source"),
                       ([ckpt, ckpt], "inside the source"),
                       ([ckpt, str(tmp_path / "u"), "--to", "deepspeed-universal", "--dtype", "fp32"],
                        "--dtype apply to --to weights only"),
                       ([ckpt, str(tmp_path / "u"), "--to", "torch-dist", "--max-shard-size", "5GB"],
                        "--max-shard-size apply to --to weights only")):
        assert main(["convert", *argv]) == 2, argv
        assert says in capsys.readouterr().err, argv
    assert not os.path.exists(f"{ckpt}/s1/weights") and not os.path.exists(tmp_path / "u")
    # an option of another format, or one a command has no use for: a usage error, nothing written
    for argv in (["convert", ckpt, str(tmp_path / "w"), "--optimizer", "torch.optim.AdamW"],
                 ["clean", "--storage-options", "{}"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err, argv
    assert not os.path.exists(tmp_path / "w")


def test_weights_export_in_bf16(tmp_path):
    from safetensors.torch import load_file
    src, out = str(tmp_path / "ck"), tmp_path / "w"
    w = torch.linspace(-3, 3, 12, dtype=torch.float32).view(3, 4)
    Checkpointer(options=Options(fsync=False)).save(SoloComm(), src, "s1", lambda: LocalState(
        [LocalShard("model/w", "model", (3, 4), Box.full((3, 4)), w)], step=1))
    assert main(["convert", src, str(out), "--dtype", "bf16"]) == 0
    got = load_file(str(out / "model.safetensors"))
    assert list(got) == ["w"] and got["w"].dtype == torch.bfloat16 and torch.equal(got["w"], w.to(torch.bfloat16))


def test_sizes_count_as_hugging_face_does():
    assert _size("5GB") == 5 * 10 ** 9 and _size("5GiB") == 5 * 2 ** 30 and _size("1.5MB") == 1_500_000
    assert _size("3KiB") == 3072 and _size("1048576") == 1048576 and _size("2TB") == 2 * 10 ** 12
    # a lowercase b after a decimal unit is bits, as Hugging Face reads it
    assert _size("5Gb") == 625_000_000 and _size("2tb") == 2 * 10 ** 12 // 8 and _size("5Gib") == 5 * 2 ** 30
    for bad in ("5 gigs", "GB", "5G", "-1"):
        with pytest.raises(Exception):
            _size(bad)


def test_ls_and_verify_name_the_damage_once(ckpt, tmp_path, capsys):
    """A shard cut short is "damaged" for ls (sizes only) and one BAD line for verify, however many
    boxes it held; flipped bytes are found by ls --verify and verify; --json says the same."""
    import json
    import shutil
    cut, flipped = str(tmp_path / "cut"), str(tmp_path / "flipped")
    shutil.copytree(ckpt, cut)
    shutil.copytree(ckpt, flipped)
    shard = [f for f in os.listdir(f"{cut}/s1") if f.endswith(".safetensors")]
    assert len(shard) == 1
    os.truncate(f"{cut}/s1/{shard[0]}", os.path.getsize(f"{cut}/s1/{shard[0]}") // 2)
    with open(f"{flipped}/s1/{shard[0]}", "r+b") as f:
        f.seek(-100, os.SEEK_END)
        f.write(b"\xff" * 8)
    assert main(["ls", ckpt, "--json"]) == 0
    assert [r["state"] for r in json.loads(capsys.readouterr().out)] == ["unverified"]
    assert main(["ls", cut, "--json"]) == 1
    (row,) = json.loads(capsys.readouterr().out)
    assert row["state"] == "damaged" and shard[0] in row["note"], row
    assert main(["ls", flipped]) == 0 and "unverified" in capsys.readouterr().out   # (sizes are right)
    assert main(["ls", flipped, "--verify"]) == 1 and "damaged" in capsys.readouterr().out
    assert main(["verify", cut]) == 1
    out = capsys.readouterr().out
    bad = [line for line in out.splitlines() if line.startswith("BAD")]
    assert len(bad) == 1 and shard[0] in bad[0], out
    assert main(["verify", flipped, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["ok"] and report["boxes"] == len(SHAPES) and report["verified"] == len(SHAPES) - 1
    assert [d["file"] for d in report["damage"]] == shard and len(report["damage"][0]["tensors"]) == 1
    assert main(["verify", ckpt, "--json"]) == 0 and json.loads(capsys.readouterr().out)["ok"]


def test_ls_verify_and_verify_show_progress_in_bytes(ckpt, capsys, monkeypatch):
    """A long verification is not silent: ``ls --verify`` and ``verify`` draw a bar of the bytes
    checked (on a terminal; ADACHECK_PROGRESS=1 anywhere) that ends at every byte of the tensors
    the checkpoint was given; --json draws none."""
    from adacheck.checkpoint import human
    everything = sum(4 * a * b for a, b in SHAPES.values())     # (fp32 tensors of these shapes)
    monkeypatch.setenv("ADACHECK_PROGRESS", "1")
    for argv, what in ((["ls", ckpt, "--verify"], "verify s1"), (["verify", ckpt], "verify")):
        assert main(argv) == 0
        err = capsys.readouterr().err
        last = err.rstrip("\n").split("\r")[-1]
        assert last.startswith(f"{what} [") and last.endswith(f"100.0% {human(everything)}/{human(everything)}"), err[-300:]
        assert err.count("\r") > 1, err[-300:]      # (drawn as it goes, not once at the end)
    assert main(["ls", ckpt, "--verify", "--json"]) == 0 and capsys.readouterr().err == ""


def test_ls_tells_an_interrupted_save_from_a_damaged_one(ckpt, tmp_path, capsys):
    """A checkpoint without a manifest (an interrupted save) is INCOMPLETE; one whose manifest
    cannot be read, or that misses a shard file, is damaged (exit 1); each note is the whole
    message, not its last part."""
    import json
    import shutil
    d = str(tmp_path / "save")
    for tag in ("good", "torn", "garbled", "lost"):
        shutil.copytree(f"{ckpt}/s1", f"{d}/{tag}")
    os.remove(f"{d}/torn/manifest.json")
    with open(f"{d}/garbled/manifest.json", "w") as f:
        f.write("{not: json")
    shard = next(f for f in os.listdir(f"{d}/lost") if f.endswith(".safetensors"))
    os.remove(f"{d}/lost/{shard}")
    assert main(["ls", d, "--json"]) == 1
    rows = {r["tag"]: r for r in json.loads(capsys.readouterr().out)}
    assert {t: r["state"] for t, r in rows.items()} == {"good": "unverified", "torn": "INCOMPLETE",
                                                         "garbled": "damaged", "lost": "damaged"}, rows
    assert rows["garbled"]["note"].startswith("garbled/manifest.json: "), rows["garbled"]
    assert "not valid JSON" in rows["garbled"]["note"], rows["garbled"]
    assert rows["lost"]["note"] == f"{shard} is missing", rows["lost"]
    assert rows["torn"]["note"].startswith("torn has no manifest.json"), rows["torn"]
    shutil.rmtree(f"{d}/garbled")
    shutil.rmtree(f"{d}/lost")
    assert main(["ls", d]) == 0       # an interrupted save is no damage
    assert "INCOMPLETE" in capsys.readouterr().out


def test_replaying_a_checkpoint_without_deltas_has_nothing_to_do(ckpt, tmp_path, capsys):
    out = str(tmp_path / "new")
    assert main(["convert", ckpt, out, "--to", "adacheck"]) == 0
    said = capsys.readouterr().out
    assert "nothing to do" in said and "no committed online deltas" in said, said
    assert not os.path.exists(out)


BLOCKED = """
import sys
class Block:      # an environment without the frameworks: importing them fails
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("deepspeed", "megatron"):
            raise ImportError(f"{name} is not installed here")
sys.meta_path.insert(0, Block())
from adacheck.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_the_core_and_its_cli_need_neither_deepspeed_nor_megatron(ckpt):
    for argv in (["ls", ckpt], ["inspect", ckpt, "--json"], ["verify", ckpt], ["diff", ckpt, ckpt],
                 ["prune", ckpt, "--keep-last", "1"]):
        p = subprocess.run([sys.executable, "-c", BLOCKED, *argv], cwd=ROOT, capture_output=True, text=True,
                           timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
        assert p.returncode == 0, (argv, p.stdout[-2000:], p.stderr[-3000:])


def test_an_untested_framework_version_is_named():
    from adacheck.compat import untested
    assert untested("deepspeed", "0.19.8") is None and untested("megatron-core", "0.16.1") is None
    assert untested("megatron-core", "0.19.0") is None and untested("megatron-core", "0.20.0") is not None
    text = untested("deepspeed", "0.18.2")
    assert "0.19.x" in text and "0.18.2" in text


def test_importing_the_integration_warns_on_an_untested_version(tmp_path):
    # a DeepSpeed whose installed metadata says 0.18.2 (a dist-info found first on the path):
    # importing adacheck_ds names that version in an UntestedVersionWarning
    meta = tmp_path / "deepspeed-0.18.2.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.18.2\n")
    code = ("import warnings\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always'); import adacheck_ds\n"
            "print([f'{x.category.__name__}: {x.message}' for x in w if x.category.__name__ == 'UntestedVersionWarning'])")
    env = dict(os.environ, DS_ACCELERATOR="cpu",
               PYTHONPATH=os.pathsep.join([str(tmp_path)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    said = p.stdout.strip().splitlines()[-1]
    assert "UntestedVersionWarning" in said and "deepspeed" in said and "0.18.2" in said, p.stdout


def test_an_output_that_cannot_be_written_is_a_clean_error(tmp_path, capsys):
    src = str(tmp_path / "ck")
    w = torch.arange(6.0).view(2, 3)
    Checkpointer(options=Options(fsync=False)).save(SoloComm(), src, "s1", lambda: LocalState(
        [LocalShard("model/w", "model", (2, 3), Box.full((2, 3)), w)], step=1))
    (tmp_path / "afile").write_text("x")
    for out, says in ((str(tmp_path / "afile"), "is a file"), ("/proc/adacheck-nowhere/out", "/proc/adacheck-nowhere")):
        assert main(["convert", src, out]) == 2, out
        err = capsys.readouterr().err
        assert err.startswith("adacheck convert: error:") and says in err and len(err.splitlines()) == 1, err
    assert (tmp_path / "afile").read_text() == "x"


def test_every_command_and_option_says_what_it_does():
    from adacheck.cli import CONVERSIONS, build_parser
    p = build_parser()
    subs = next(a for a in p._actions if a.dest == "cmd").choices
    for name, s in subs.items():
        assert s.description, name
        for a in s._actions:
            assert a.help, (name, a.option_strings or a.dest)
    assert all(a.help for a in p._actions if a.dest != "cmd")
    for direction in ("--to weights", "--to deepspeed", "--to deepspeed-universal", "--to torch-dist",
                      "--from deepspeed", "--from torch-dist", "--to adacheck"):
        assert direction in CONVERSIONS, direction
    assert CONVERSIONS in p.description


def test_help_and_version_answer_without_importing_torch():
    code = ("import sys\nfrom adacheck.cli import main\nfor argv in (['--help'], ['--version'], ['ls', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\nprint('torch' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0 and p.stdout.strip().endswith("False"), (p.stdout[-500:], p.stderr[-2000:])


def test_redundancy_counts_what_ranks_hold_of_derived_tensors(tmp_path, capsys):
    """A derived tensor (bf16 weights, a proven cast of the masters) is not stored but is held:
    the --redundancy table counts it as the summary's "held by all ranks" does."""
    import json
    from test_core_storage import state
    _, st = state(3, torch.zeros(3, 3))
    root = str(tmp_path / "ck")
    Checkpointer(options=Options(fsync=False)).save(SoloComm(), root, "s3", lambda: st)
    assert main(["inspect", root, "--json", "--redundancy"]) == 0
    s = json.loads(capsys.readouterr().out)
    kinds = s["redundancy"]["kinds"]
    assert kinds["model"]["derived"] == 6 * 4 * 2                       # model/w: bf16 (6, 4), not stored
    assert kinds["model"]["held"] == 6 * 4 * 2 + 9 * 4                  # ... but held, as is model/frozen
    assert sum(v.get("held", 0) for v in kinds.values()) == s["stats"]["held_bytes"]
