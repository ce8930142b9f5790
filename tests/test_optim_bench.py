"""`hpcdl bench optim` writes the bench JSON convention with the LARS/SGD step-time ratio."""
import json

from hpcdl.cli.main import main


def test_bench_optim_writes_ratio(tmp_path, capsys):
    out = tmp_path / "optim.json"
    assert main(["bench", "optim", "--model", "resnet_small", "--steps", "2", "--warmup", "1",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["bench"] == "optim"
    assert [r["optimizer"] for r in report["results"]] == ["sgd_foreach", "lars"]
    assert all(r["median_ms"] > 0 and r["threads"] == 1 for r in report["results"])
    ratio = report["ratios"]["lars_vs_sgd_step_time"]
    assert ratio == report["results"][1]["median_ms"] / report["results"][0]["median_ms"]
    assert "lars_vs_sgd_step_time" in capsys.readouterr().out
