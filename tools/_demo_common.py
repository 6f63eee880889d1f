"""What the CPU demo drivers (``tools/run_demo_*.py``) share.

Each step of a demo is one of the repository's tools, run as a child process
with its output in a log file; :func:`run_step` prints the command, the wall
and CPU time it took and, when it fails, the end of its log;
:func:`child_env` is the steps' environment. :func:`read_test_metrics` reads
the metrics ``tools/test.py`` dumped.
"""
import glob
import json
import os
import os.path as osp
import resource
import subprocess
import time
from typing import Dict, List, Mapping, Optional

ROOT = osp.dirname(osp.dirname(osp.abspath(__file__)))


def children_cpu() -> float:
    """CPU seconds (user + system) of the finished child processes so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def child_env() -> Dict[str, str]:
    """The environment of the steps: this process's, with ``OMP_WAIT_POLICY=PASSIVE``
    unless set.

    Idle OpenMP threads then sleep instead of spinning. On a machine whose
    cores are shared with other jobs, spinning threads slow PyTorch's CPU
    kernels down several times over; on an idle machine the setting costs next
    to nothing.
    """
    env = dict(os.environ)
    env.setdefault('OMP_WAIT_POLICY', 'PASSIVE')
    return env


def run_step(title: str, cmd: List[str], log: str, *, tag: str, cwd: str = ROOT,
             env: Optional[Mapping[str, str]] = None) -> float:
    """Run one tool, its output to ``log``; returns the wall-clock seconds it took.

    Args:
        title: what the step does, for the messages.
        cmd: the command line.
        log: file that receives the step's stdout and stderr.
        tag: prefix of the messages (``[tag]``).
        cwd: working directory of the step (the repository root).
        env: environment of the step (default: this process's).

    Raises:
        SystemExit: the step failed; the message holds the last lines of its log.
    """
    print(f'[{tag}] {title}: {" ".join(cmd)}', flush=True)
    start, cpu = time.time(), children_cpu()
    with open(log, 'w') as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=cwd,
                              env=None if env is None else dict(env))
    seconds, cpu = time.time() - start, children_cpu() - cpu
    if proc.returncode != 0:
        with open(log) as f:
            tail = ''.join(f.readlines()[-30:])
        raise SystemExit(f'[{tag}] {title} failed (exit {proc.returncode}); last lines of '
                         f'{log}:\n{tail}')
    # CPU seconds too: on a shared machine the wall clock says little.
    print(f'[{tag}]   done in {seconds:.0f} s ({cpu:.0f} CPU s; log: {log})', flush=True)
    return seconds


def read_test_metrics(work_dir: str, *, tag: str) -> Dict[str, float]:
    """The metrics of the latest ``tools/test.py`` run with this work dir, which
    dumped them as ``WORK_DIR/<timestamp>/<timestamp>.json``."""
    dumps = sorted(p for p in glob.glob(osp.join(work_dir, '*', '*.json'))
                   if osp.basename(p) == osp.basename(osp.dirname(p)) + '.json')
    if not dumps:
        raise SystemExit(f'[{tag}] no test metrics (<timestamp>/<timestamp>.json) in '
                         f'{work_dir}')
    with open(dumps[-1]) as f:
        return json.load(f)
