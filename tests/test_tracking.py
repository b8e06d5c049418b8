# python -m pytest tests/test_tracking.py
"""swanlab, read back the way its local dashboard (`swanlab watch`) reads it: a short SFT run in docs/training.md's
recommended mode (--swanlab_mode local) is served by swanboard's own web app, in-process, and every logged series
(loss, lr, grad_norm, eval/accuracy) holds the values of NAME_metrics.jsonl at every logged step; the config holds
the settings the run really used (fp32 on CPU, device, world size) and no None placeholders.

A broken install (swanboard under peewee 4: "cannot commit - no transaction is active") leaves the charts without
data and fails here. Without the dashboard's packages (swanlab's dashboard extra: swanboard, fastapi) that test skips,
saying so; the module still collects, and its other tests run."""
import argparse
import os

import pytest

from loop_helpers import loop_args, metrics
from trainer.skeleton.tracking import tracker_config
from trainer.train_sft import main as train_sft


def dashboard(swanlog_dir: str, monkeypatch):
    """swanboard's web app on SAVE_DIR/swanlog, as `swanlab watch SAVE_DIR/swanlog` serves it, as fastapi's
    TestClient."""
    from fastapi.testclient import TestClient
    from swanboard.db import connect
    from swanboard.app import app
    monkeypatch.setenv("SWANLAB_LOG_DIR", swanlog_dir)  # where swanboard looks for the run folders
    connect(path=swanlog_dir)
    return TestClient(app)


def api(client, path: str):
    response = client.get(f"/api/v1/{path}")
    assert response.status_code == 200, f"{path}: {response.status_code} {response.text[:500]}"
    body = response.json()
    assert body["code"] == 0, f"{path}: {body}"
    return body["data"]


def test_local_dashboard_shows_every_logged_series_and_the_effective_config(tiny_config_path, chat_jsonl, tmp_path,
                                                                             monkeypatch, one_thread):
    for package in ("swanlab", "swanboard", "fastapi.testclient"):  # swanlab with its dashboard extra
        pytest.importorskip(package, reason=f"no {package}: pip install -r requirements.txt (swanlab[dashboard])")
    monkeypatch.delenv("SWANLAB_LOG_DIR", raising=False)  # swanlab's local mode sets it for the process; undo that
    train_sft(loop_args(tiny_config_path, chat_jsonl, tmp_path, name="sft", batch=4, max_steps=3, device="cpu",
                        dtype="auto", use_swanlab=1, swanlab_mode="local", eval_interval=2,
                        eval_data_path=chat_jsonl, eval_rows=2, eval_max_new_tokens=4))
    logged = metrics(tmp_path, "sft")
    train = [m for m in logged if "loss" in m]
    evals = [m for m in logged if "eval/accuracy" in m]
    assert [m["step"] for m in train] == [1, 2, 3] and [m["step"] for m in evals] == [0, 2, 3]

    client = dashboard(str(tmp_path / "swanlog"), monkeypatch)
    experiments = api(client, "project")["experiments"]
    assert [e["name"] for e in experiments] == ["sft"]
    experiment_id = experiments[0]["id"]

    charts = {c["name"]: c for c in api(client, f"experiment/{experiment_id}/chart")["charts"]}
    for name, records in (("loss", train), ("lr", train), ("grad_norm", train), ("eval/accuracy", evals)):
        assert name in charts and not charts[name]["error"], f"chart {name}: {charts.get(name)}"
        series = api(client, f"experiment/{experiment_id}/tag/{name}")["list"]
        assert {point["index"]: point["data"] for point in series} == {m["step"]: m[name] for m in records}, name

    config = {key: item["value"] for key, item in api(client, f"experiment/{experiment_id}")["config"].items()}
    assert config["dtype"] == "float32" and config["requested_dtype"] == "auto"  # auto resolved: fp32 on a CPU
    assert config["device"] == "cpu" and config["world_size"] == 1
    assert config["model_path"] == "none"  # a None flag, which swanlab would show as {}
    assert config["data_path"] == os.path.abspath(chat_jsonl)  # what was read, as the run resolved it
    assert not [key for key, value in config.items() if value in ({}, None)], config


@pytest.mark.parametrize("device, requested, expected", [("cpu", "auto", "float32"), ("cpu", "bfloat16", "bfloat16"),
                                                         ("cuda:1", "auto", "bfloat16"),
                                                         ("cuda:1", "bfloat16", "bfloat16"),
                                                         ("cuda", "float16", "float16")])
def test_config_records_the_dtype_the_run_trained_in(device, requested, expected, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    args = argparse.Namespace(device="cuda", dtype=requested, model_path=None, learning_rate=1e-3)
    config = tracker_config(args, effective={"device": device})
    assert config["dtype"] == expected and config["requested_dtype"] == requested
    assert config["device"] == device and config["world_size"] == 2 and config["model_path"] == "none"
    assert tracker_config(args, {"device": device, "world_size": 8})["world_size"] == 8
    assert tracker_config(args)["device"] == "cuda"  # without `effective`: the flag and the torchrun environment


def test_the_logged_config_names_the_defaulted_model_config_and_data(tmp_path, monkeypatch):
    from trainer.config.sft import parse_args
    args = parse_args(["--save_dir", str(tmp_path)])
    assert args.model_config.endswith(os.path.join("model", "configs", "qwen3-tiny.json"))
    config = tracker_config(args, {"device": "cpu", "world_size": 1, "dtype": "float32",
                                   "data_path": "/data/demo/sft_train.parquet"})
    assert config["model_config"] == args.model_config and config["data_path"] == "/data/demo/sft_train.parquet"
