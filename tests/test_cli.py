"""supervisor/cli.py: --version, `run --help` with a job.toml example, and `report`'s bad input."""
import os
import re
import tomllib

from shared.job import parse_toml
from tests.scenarios import cli


def test_version():
    """`supervisor --version` prints the installed version, where the packages come from, and the Python."""
    from importlib.metadata import version

    proc = cli.run("--version")
    assert re.fullmatch(rf"supervisor {re.escape(version('layerwise-supervisor'))} \(layerwise-supervisor; "
                        r"packages in /\S+; Python 3\.\d+\.\d+\)\n", proc.stdout), proc.stdout


def test_run_help_shows_a_valid_job_file():
    """`supervisor run --help` ends with a job.toml example that parses as a valid job: the README's."""
    text = cli.run("run", "--help").stdout
    example = text[text.index("[source]"):]
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")) as f:
        readme = f.read()
    assert readme[readme.index("# job.toml\n") + len("# job.toml\n"):].startswith(example.rstrip("\n") + "\n```")
    assert "[export]" in example and "[resources]" in example
    job = parse_toml(example)
    assert (job.export.scheme, job.resources.device) == ("FP8_DYNAMIC", "auto")
    assert tomllib.loads(example)["source"]["path"] == "models/my-llama"


def test_report_bad_input_and_an_old_journal(tmp_path):
    """A folder without a journal, or an --html path in a missing folder: one line, exit 2, no file; a journal
    written before the report's fields existed still reports (zeros, "-" for the peaks no worker reported; no
    error)."""
    proc = cli.run("report", tmp_path, check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "holds no export journal" in proc.stderr
    (tmp_path / ".export").mkdir()
    (tmp_path / ".export" / "journal.jsonl").write_text(
        '{"type":"Header","version":1,"fingerprint":"x","job":{"source":{"path":"m"},"export":{"scheme":"W4A16",'
        '"output":"o"}},"num_layers":2}\n')
    proc = cli.run("report", tmp_path, "--html", tmp_path / "missing" / "r.html", check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "does not exist" in proc.stderr
    proc = cli.run("report", tmp_path, "--html", tmp_path / "r.html", check=False)
    assert proc.returncode == 2 and "inside the export" in proc.stderr
    assert sorted(os.listdir(tmp_path)) == [".export"]
    proc = cli.run("report", tmp_path)  # an export with nothing journaled yet
    assert "0/3 shards journaled, not finished; left: 0, 1, non-layer" in proc.stdout
    with open(tmp_path / ".export" / "journal.jsonl", "a") as f:  # a record from before the report's fields
        f.write('{"type":"Shard","index":0,"file":"model-layer-00000.safetensors","digest":"xxh3-128:00",'
                '"nbytes":3145728,"seconds":1.5}\n')
    rows = [ln.split() for ln in cli.run("report", tmp_path).stdout.splitlines() if ln.split()[:1] == ["0"]]
    assert rows == [["0", "1.50", "0.00", "3.00", "-", "-", "0", "-", "-"]]
