import subprocess
import sys

from hpcdl.cli.main import build_parser


def test_help_lists_bench_command():
    out = subprocess.run([sys.executable, "-m", "hpcdl.cli.main", "--help"],
                         capture_output=True, text=True, check=True).stdout
    assert "bench" in out


def test_unknown_command_is_an_argparse_error():
    parser = build_parser()
    try:
        parser.parse_args(["no-such-command"])
    except SystemExit as exc:
        assert exc.code == 2
    else:
        raise AssertionError("unknown command was accepted")
