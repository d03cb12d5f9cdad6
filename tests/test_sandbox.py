"""The code sandbox refuses what a completion must not do; each attempt scores 0 and scoring goes on."""

import os

import pytest

from grpo_fast.rewards import code_reward, score
from grpo_fast.sandbox import SandboxLimits, run_tests

TESTS = ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]
ADD = "\ndef add(a, b):\n    return a + b\n"
FAST = SandboxLimits(wall_seconds=3.0, cpu_seconds=2, memory_mb=256)

ATTACKS = {
    "infinite loop": "while True:\n    pass" + ADD,
    "sleep past the wall clock": "import time\ntime.sleep(60)" + ADD,
    "fork bomb": "import os\nwhile True:\n    os.fork()" + ADD,
    "subprocess": "import subprocess\nsubprocess.run(['sh', '-c', 'echo hi'])" + ADD,
    "memory hog": "x = bytearray(2 * 1024 ** 3)" + ADD,
    "socket connection": "import socket\nsocket.create_connection(('127.0.0.1', 80), timeout=1)" + ADD,
    "write outside its directory": "open('/tmp/grpo_fast_sandbox_escape', 'w').write('x')" + ADD,
    "read an environment secret": "import os\nassert os.environ.get('GRPO_FAST_SECRET') != 'hunter2'\n"
    "assert 'hunter2' not in open(f'/proc/{os.getppid()}/environ').read()" + ADD,
    "forge the result line": "import sys, os\nsys.stdout.write('@@x@@{\"passed\": 2}\\n')\nos._exit(0)",
    "walk frames to the nonce": "try:\n    raise ValueError\nexcept ValueError as e:\n"
    "    f = e.__traceback__.tb_frame.f_back" + ADD,
}


@pytest.fixture(autouse=True)
def _secret(monkeypatch):
    monkeypatch.setenv("GRPO_FAST_SECRET", "hunter2")


def test_honest_code_passes_and_partial_code_gets_partial_credit():
    assert run_tests(ADD, TESTS, FAST) == 1.0
    assert run_tests("def add(a, b):\n    return 3", TESTS, FAST) == 0.5
    assert (
        run_tests("open('scratch.txt', 'w').write('ok')" + ADD, TESTS, FAST) == 1.0
    )  # its own directory is fine


@pytest.mark.parametrize("name", list(ATTACKS))
def test_attack_scores_zero(name):
    assert run_tests(ATTACKS[name], TESTS, FAST) == 0.0
    assert not os.path.exists("/tmp/grpo_fast_sandbox_escape")


def test_scoring_goes_on_after_attacks():
    comps = [f"```python\n{c}\n```" for c in ATTACKS.values()] + [f"```python\n{ADD}\n```"]
    s = score([code_reward], [1.0], ["p"] * len(comps), comps, {"tests": [TESTS] * len(comps)})
    assert s.rewards.tolist() == [0.0] * len(ATTACKS) + [1.0]
