"""Cost of layer attention against depth: parameters, FLOPs, time and memory.

The logic behind ``tools/analysis_tools/benchmark_layer_attention.py``. Every
candidate is a backbone (method x depth) built from the same ``KCLAResNet``
machinery; the plain ResNet (``layer_attn=None``) of the same depth is the
baseline, measured in the same run.

Two depth families:

* ``imagenet``: ResNet-50/101/152 (Bottleneck, 4 stages, ``head_dim=64``);
* ``cifar``: the CIFAR ResNets (``CifarKCLAResNet``, the backbone of the
  CIFAR-100 configs): a 3x3 stem without max-pooling, then 3 stages of ``n``
  blocks (``head_dim=16``). By default the BasicBlock networks of He et al.
  (2016, section 4.2), depth ``6n + 2``, 16, 32 and 64 channels;
  ``cifar_block='Bottleneck'`` gives the layer-attention papers' networks,
  depth ``9n + 2``, 64, 128 and 256 channels. Deep and narrow, so the
  quadratic history of exact layer attention shows.

Measurements (see :func:`measure_times` and :func:`peak_train_memory`):

* forward: one eval-mode forward under ``torch.no_grad()``;
* training step: forward in train mode + ``loss.backward()`` of the mean of the
  output (no optimiser step), gradients reset to ``None`` before each step;
* peak memory of a training step: on CUDA ``torch.cuda.max_memory_allocated``;
  on CPU, where torch has no allocator statistics, the peak of live tensor
  bytes during the step, tracked by a ``TorchDispatchMode`` that registers every
  tensor storage an aten op creates (forward and backward) and a weak reference
  that subtracts it when the storage is freed, plus the parameters, buffers and
  input alive before the step. Memory allocated outside aten ops (kernel
  workspaces of oneDNN) is not seen. The same method is applied to every
  candidate.
"""
import math
import os
import platform
import statistics
import sys
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

#: torch's switch for huge pages on the CPU: allocations of 2 MB and more are
#: 2 MB-aligned and ``madvise(MADV_HUGEPAGE)``-d. c10 reads it once, at torch's
#: first allocation, so it must be in the environment before torch starts.
THP_ENV = 'THP_MEM_ALLOC_ENABLE'

#: The CPU allocator settings the benchmarks run every candidate under (glibc
#: reads its variables at start-up): torch's huge pages, and glibc's malloc
#: told to keep freed memory (never ``mmap`` a block of its own, never return
#: the heap's top to the system). Without the last two, glibc gives large
#: freed blocks back to the system and the next step faults them in again,
#: one page at a time: on the AMD VM a ResNet-50 training step at batch 4
#: took 56k (plain) and 95k (KCLA) page faults with the default allocator,
#: 20k and 68k with huge pages alone, none with these settings (KCLA's
#: kernels allocate their output maps afresh at every call, as aten ops do).
#: The process then keeps the memory of its largest step, as torch's CUDA
#: caching allocator does. Where a glibc ignores the variables, the fault
#: counts of the benchmark's table show it.
TUNED_ALLOCATOR_ENV: Dict[str, str] = {
    THP_ENV: '1',
    'MALLOC_MMAP_THRESHOLD_': str(2**32),  # bytes: blocks below this come from the heap
    'MALLOC_TRIM_THRESHOLD_': str(2**34),  # bytes of free heap top kept before trimming
}


def tuned_allocator_on() -> bool:
    """Whether every variable of :data:`TUNED_ALLOCATOR_ENV` is set (to any value)."""
    return all(os.environ.get(k, '').strip() for k in TUNED_ALLOCATOR_ENV)


def restart_with_tuned_allocator(argv: Optional[Sequence[str]] = None) -> None:
    """Re-execute this script under :data:`TUNED_ALLOCATOR_ENV` unless it is set (Linux only).

    Variables the caller has set keep their values. Every candidate of a
    benchmark then runs on the same allocator. Does not return when it
    restarts.
    """
    if tuned_allocator_on() or not sys.platform.startswith('linux'):
        return
    argv = list(sys.argv if argv is None else argv)
    env = dict(TUNED_ALLOCATOR_ENV)
    env.update({k: v for k, v in os.environ.items() if k not in env or v.strip()})
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable] + argv, env)


def allocator_description() -> str:
    """One line for a benchmark header: the CPU allocator settings of the run."""
    settings = ' '.join(f'{k}={os.environ[k]}' for k in TUNED_ALLOCATOR_ENV
                        if os.environ.get(k, '').strip())
    if all(os.environ.get(k, '').strip() == v for k, v in TUNED_ALLOCATOR_ENV.items()):
        return (f'CPU allocator: {settings} for every candidate (torch on transparent huge '
                'pages; glibc keeps freed memory instead of returning it to the system)')
    if tuned_allocator_on():  # the caller's own values
        return f'CPU allocator: {settings} for every candidate (as set in the environment)'
    settings = settings or "glibc's and torch's defaults"
    return (f'CPU allocator: {settings} (not the tuned settings of '
            'kcla_mm.analysis.benchmark.TUNED_ALLOCATOR_ENV)')


def minor_faults() -> Optional[int]:
    """Minor page faults of this process so far (``None`` where ``resource`` is missing)."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


#: (cpuinfo flag, name) of the vector instruction sets the CPU kernels and
#: oneDNN choose their code by, widest first
_VECTOR_ISAS = (('avx512f', 'AVX-512'), ('avx2', 'AVX2'), ('sve', 'SVE'), ('asimd', 'NEON'))


def _read_text(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _cpuinfo_value(keys: Sequence[str], cpuinfo: str) -> Optional[str]:
    """The value of the first ``key : value`` line of ``cpuinfo`` whose key is in ``keys``."""
    for line in (_read_text(cpuinfo) or '').splitlines():
        key, sep, value = line.partition(':')
        if sep and key.strip() in keys:
            return value.strip()
    return None


def cpu_name(cpuinfo: str = '/proc/cpuinfo') -> str:
    """The CPU's model name (``/proc/cpuinfo``, else what ``platform`` knows)."""
    return (_cpuinfo_value(('model name', ), cpuinfo) or platform.processor()
            or platform.machine())


def _size_text(kib: int) -> str:
    return f'{kib // 1024} MiB' if kib >= 1024 and kib % 1024 == 0 else f'{kib} KiB'


def cpu_features(cpuinfo: str = '/proc/cpuinfo',
                 cache_dir: str = '/sys/devices/system/cpu/cpu0/cache') -> str:
    """The CPU's widest vector instructions and its L2/L3 sizes, for a benchmark header.

    E.g. ``'AVX-512, AMX; L2 2 MiB, L3 480 MiB'``. The ratios of the benchmark
    depend on these: the plain ResNet's convolutions run faster on wider
    vectors, while KCLA's passes over the maps are bound by memory traffic.
    Whatever cannot be read is left out (``''`` where nothing can).
    """
    parts = []
    flags = (_cpuinfo_value(('flags', 'Features'), cpuinfo) or '').split()
    isa = next((name for flag, name in _VECTOR_ISAS if flag in flags), None)
    if isa is not None:
        parts.append(isa + (', AMX' if 'amx_tile' in flags else ''))
    caches = {}
    for index in sorted(os.listdir(cache_dir)) if os.path.isdir(cache_dir) else []:
        level, kind, size = (_read_text(os.path.join(cache_dir, index, name)) or ''
                             for name in ('level', 'type', 'size'))
        level, kind, size = level.strip(), kind.strip(), size.strip()
        if (level.isdigit() and int(level) >= 2 and kind in ('Unified', 'Data')
                and size.endswith('K') and size[:-1].isdigit()):
            caches[int(level)] = int(size[:-1])
    if caches:
        parts.append(', '.join(f'L{lv} {_size_text(kib)}' for lv, kib in sorted(caches.items())))
    return '; '.join(parts)


#: candidate methods, baseline first; ``none`` is the plain ResNet.
METHODS: Tuple[str, ...] = ('none', 'MRLALight', 'FullLayerAttention', 'KCLA')
IMAGENET_DEPTHS: Tuple[int, ...] = (50, 101, 152)
CIFAR_DEPTHS: Tuple[int, ...] = (20, 56, 110, 254)


@dataclass(frozen=True)
class Candidate:
    """One backbone to measure.

    Attributes:
        family: ``imagenet`` or ``cifar``.
        depth: network depth.
        method: one of :data:`METHODS`.
        compiled: run through ``torch.compile``.
    """

    family: str
    depth: int
    method: str
    compiled: bool = False

    @property
    def name(self) -> str:
        prefix = 'ResNet' if self.family == 'imagenet' else 'CIFAR-ResNet'
        return f'{prefix}-{self.depth} {self.method}{" +compile" if self.compiled else ""}'

    @property
    def baseline(self) -> 'Candidate':
        """The plain ResNet of the same depth (and compilation)."""
        return Candidate(self.family, self.depth, 'none', self.compiled)


def build_backbone(family: str, depth: int, method: str, tiny: bool = False,
                   channels_last: Optional[bool] = None,
                   recompute_attn_outputs: bool = True,
                   cifar_block: str = 'BasicBlock') -> nn.Module:
    """The backbone of a candidate (random initialisation, BatchNorm in training mode).

    Args:
        family: ``imagenet`` or ``cifar``.
        depth: depth of the family.
        method: one of :data:`METHODS`.
        tiny: a quarter of the ImageNet widths / half of the CIFAR widths (smoke tests).
        channels_last: the backbone's ``channels_last`` argument (``None``: its default).
        recompute_attn_outputs: the backbone's argument of that name.
        cifar_block: the ``block`` of the ``cifar`` family, ``'BasicBlock'``
            (depth ``6n + 2``) or ``'Bottleneck'`` (``9n + 2``).
    """
    if method not in METHODS:
        raise ValueError(f'method={method!r}; choose from {METHODS}')
    # the hosts (mmdet; mmpretrain for the CIFAR family) are imported here,
    # not with this module
    layer_attn = None if method == 'none' else dict(type=method)
    kw: Dict[str, Any] = dict(layer_attn=layer_attn, channels_last=channels_last,
                              recompute_attn_outputs=recompute_attn_outputs)
    if family == 'imagenet':
        from ..models.backbones.mmdet_kcla_resnet import KCLAResNet
        if tiny:
            kw.update(base_channels=16, head_dim=16)
        model = KCLAResNet(depth=depth, out_indices=(3, ), norm_eval=False, init_cfg=None, **kw)
    elif family == 'cifar':
        from ..models.backbones.cifar_kcla_resnet import CifarKCLAResNet
        if tiny:
            kw.update(stem_channels=8, base_channels=8, head_dim=8)
        model = CifarKCLAResNet(depth=depth, block=cifar_block, init_cfg=None, **kw)
    else:
        raise ValueError(f"family={family!r}; choose 'imagenet' or 'cifar'")
    if method != 'none':
        for m in model.layer_attn_modules():
            m.reset_parameters()
    return model


def num_blocks(model: nn.Module) -> int:
    """Residual blocks of a backbone."""
    return sum(len(getattr(model, name)) for name in model.res_layers)


def _sync(device: torch.device) -> None:
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


def _loss(out: Any) -> Tensor:
    return sum(o.float().mean() for o in tree_leaves(out) if isinstance(o, Tensor))


def forward_once(model: nn.Module, x: Tensor, set_mode: bool = True) -> None:
    """One eval-mode forward without autograd.

    ``set_mode=False``: the caller has put ``model`` in eval mode already
    (:func:`run` does, outside the timed call: ``model.eval()`` walks every
    module, about 0.5 ms for a ResNet-50 and 1.1 ms for a KCLA-ResNet-50 on
    a CI VM, which is not part of a forward).
    """
    if set_mode:
        model.eval()
    with torch.no_grad():
        model(x)


def train_step(model: nn.Module, x: Tensor, set_mode: bool = True,
               params: Optional[Sequence[Tensor]] = None) -> None:
    """Forward in train mode and backward of the mean output; gradients reset first.

    ``set_mode=False``: the caller has put ``model`` in train mode already
    (see :func:`forward_once`). The gradients are reset in every step, as an
    optimiser's ``zero_grad(set_to_none=True)`` does: over ``params``, the
    list of ``model``'s parameters that an optimiser would hold (default:
    ``model.parameters()``, a walk over every module: 1.4 ms for a plain
    CIFAR-ResNet-254 and 4.8 ms for a KCLA one on a CI VM, against 0.06 and
    0.24 ms over a list; :func:`run` passes the list).
    """
    if set_mode:
        model.train()
    for p in (model.parameters() if params is None else params):
        p.grad = None
    _loss(model(x)).backward()


def timed(fn: Callable[[], None], device: torch.device) -> float:
    """Seconds taken by ``fn`` (CUDA events on CUDA, ``perf_counter`` on CPU)."""
    if device.type == 'cuda':
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of the tensor storages created by aten ops while active (CPU).

    Every storage an op outputs is counted once, until a weak reference to it
    reports that it was freed. Views and in-place results share their
    storage and are not counted again.

    Args:
        resident: tensors whose storages exist before tracking starts
            (parameters, buffers, the input) and are accounted for separately:
            never counted, also where an op returns a view of one (``detach``
            of a parameter, as saved-tensor hooks and checkpointing do).
    """

    def __init__(self, resident: Sequence[Tensor] = ()) -> None:
        super().__init__()
        self.live: Dict[int, Tuple[weakref.ref, int]] = {}
        self.current = 0
        self.peak = 0
        self._resident = [t.untyped_storage() for t in resident]  # strong: ids stay valid
        self._resident_ids = {id(s) for s in self._resident}

    def _on_free(self, key: int) -> Callable[[Any], None]:
        def callback(_: Any) -> None:
            entry = self.live.pop(key, None)
            if entry is not None:
                self.current -= entry[1]
        return callback

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, Tensor) or t.device.type == 'meta':
                continue
            storage = t.untyped_storage()
            key = id(storage)
            if key in self.live or key in self._resident_ids:
                continue
            n = storage.nbytes()
            self.live[key] = (weakref.ref(storage, self._on_free(key)), n)
            self.current += n
            self.peak = max(self.peak, self.current)
        return out


def _resident_bytes(model: nn.Module, x: Tensor) -> int:
    """Bytes of the distinct storages of parameters, buffers and the input."""
    seen = {}
    for t in list(model.parameters()) + list(model.buffers()) + [x]:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def peak_train_memory(model: nn.Module, x: Tensor) -> int:
    """Peak bytes of one training step (see the module docstring for the method)."""
    device = x.device
    if device.type == 'cuda':
        train_step(model, x)  # allocate the gradients once, as in training
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        train_step(model, x)
        _sync(device)
        return torch.cuda.max_memory_allocated(device)
    for p in model.parameters():
        p.grad = None
    before = _resident_bytes(model, x)
    tracker = LiveTensorBytes(list(model.parameters()) + list(model.buffers()) + [x])
    model.train()
    with tracker:
        _loss(model(x)).backward()
    for p in model.parameters():
        p.grad = None
    return before + tracker.peak


def count_flops(model: nn.Module, x: Tensor, elementwise: bool = True) -> int:
    """FLOPs of one eval-mode forward (:func:`kcla_mm.analysis.flop_analyzer`)."""
    from . import flop_analyzer
    model.eval()
    with torch.no_grad():
        return int(flop_analyzer(model, (x, ), elementwise=elementwise).total())


@dataclass
class Result:
    """Measurements of one candidate; times in seconds, one entry per repeat."""

    candidate: Candidate
    blocks: int
    params: int
    flops: Optional[int]
    memory: Optional[int]
    forward: List[float] = field(default_factory=list)
    train: List[float] = field(default_factory=list)
    #: minor page faults per training step, one entry per repeat (CPU, where measurable)
    faults: List[float] = field(default_factory=list)

    @property
    def forward_median(self) -> float:
        return statistics.median(self.forward) if self.forward else math.nan

    @property
    def train_median(self) -> float:
        return statistics.median(self.train) if self.train else math.nan

    @property
    def faults_median(self) -> float:
        return statistics.median(self.faults) if self.faults else math.nan


@dataclass
class Setting:
    """Input of one family: batch and square image size."""

    batch: int
    size: int


def run(candidates: Sequence[Candidate], models: Dict[Candidate, nn.Module],
        settings: Dict[str, Setting], device: torch.device, repeats: int, warmup: int,
        channels_last: bool = False,
        count_flops_fn: Optional[Callable[[nn.Module, Tensor], Optional[int]]] = None,
        progress: Optional[Callable[[str], None]] = None,
        inner: int = 1, amp: Optional[torch.dtype] = None) -> Dict[Candidate, Result]:
    """Measure every candidate, interleaved.

    Parameters, FLOPs (batch 1) and peak memory are measured once per
    candidate; on CPU the memory-tracked training step (see
    :func:`peak_train_memory`) is the candidate's first warm-up training step
    when there is a warm-up. Times: ``warmup + repeats`` rounds; in each round
    every candidate runs ``inner`` forwards back to back, then ``inner``
    training steps, each batch after an untimed ``model.eval()`` or
    ``model.train()`` (a mode switch walks every module, so timed it would
    charge the methods with more modules for something a forward does not
    do; each training step sets the gradients to ``None`` over a list of the
    parameters made once, as an optimiser holds them, not by walking the
    modules), and the round's figure is the fastest of each (the
    steady state, after the previous candidate's caches and allocator state
    are gone); the order is rotated by one candidate per round, so that
    drift (thermal, other load) affects all alike. The first ``warmup``
    rounds are discarded; the reported figure is the median over rounds.

    Args:
        candidates: what to measure.
        models: the (eager or compiled) module of each candidate, on ``device``.
        settings: per family, the input batch and size.
        device: where to run.
        repeats: timed rounds.
        warmup: untimed rounds before them.
        channels_last: feed the input in the channels-last memory format.
        count_flops_fn: counts FLOPs of an eager model on a batch-1 input, or
            returns ``None`` to skip (default :func:`count_flops`); a compiled
            candidate gets its eager count.
        progress: called with a message after each step.
        inner: back-to-back runs per candidate and round (>= 1).
        amp: run forwards and training steps (and the memory's step) under
            ``torch.autocast`` to this dtype (``torch.float16``,
            ``torch.bfloat16``); ``None``: in the parameters' dtype.
    """
    if amp is not None:
        with torch.autocast(device.type, dtype=amp):
            return run(candidates, models, settings, device, repeats, warmup,
                       channels_last=channels_last, count_flops_fn=count_flops_fn,
                       progress=progress, inner=inner)
    if inner < 1:
        raise ValueError(f'inner must be >= 1, got inner={inner!r}')
    count_flops_fn = count_flops_fn or count_flops
    fmt = torch.channels_last if channels_last else torch.contiguous_format

    def make_input(c: Candidate, batch: Optional[int] = None) -> Tensor:
        s = settings[c.family]
        g = torch.Generator().manual_seed(0)
        x = torch.rand(batch or s.batch, 3, s.size, s.size, generator=g)
        return x.to(device).contiguous(memory_format=fmt)

    results: Dict[Candidate, Result] = {}
    flops: Dict[Tuple[str, int, str], Optional[int]] = {}
    memory_in_warmup = warmup > 0 and device.type == 'cpu'
    for c in candidates:
        model = models[c]
        eager = getattr(model, '_orig_mod', model)  # torch.compile keeps the module here
        key = (c.family, c.depth, c.method)
        if key not in flops:
            flops[key] = count_flops_fn(eager, make_input(c, 1))
        memory = None
        if not memory_in_warmup and (not c.compiled or device.type == 'cuda'):
            memory = peak_train_memory(model, make_input(c))
        results[c] = Result(c, num_blocks(eager), sum(p.numel() for p in eager.parameters()),
                            flops[key], memory)
        if progress:
            progress(f'{c.name}: parameters, FLOPs' + ('' if memory_in_warmup else ' and memory'))
    inputs = {c: make_input(c) for c in candidates}
    # what an optimiser holds: the timed steps reset the gradients over it
    params = {c: list(models[c].parameters()) for c in candidates}
    n = len(candidates)
    for r in range(warmup + repeats):
        order = [candidates[(i + r) % n] for i in range(n)]
        for c in order:
            model, x = models[c], inputs[c]
            # the mode switches walk every module: set once, outside the timed calls
            model.eval()
            fwd = min(timed(lambda: forward_once(model, x, set_mode=False), device)
                      for _ in range(inner))
            if r == 0 and memory_in_warmup and not c.compiled:
                results[c].memory = peak_train_memory(model, x)  # the warm-up training step
                continue
            faults = minor_faults() if device.type == 'cpu' else None
            model.train()
            step = min(timed(lambda: train_step(model, x, set_mode=False, params=params[c]),
                             device) for _ in range(inner))
            if faults is not None:
                faults = (minor_faults() - faults) / inner
            for p in params[c]:
                p.grad = None
            if r >= warmup:
                results[c].forward.append(fwd)
                results[c].train.append(step)
                if faults is not None:
                    results[c].faults.append(faults)
        if progress:
            progress(f'round {r + 1}/{warmup + repeats}' + (' (warm-up)' if r < warmup else ''))
    return results


def _ratio(value: float, base: Optional[float]) -> str:
    if base is None or not base:
        return 'n/a'
    return f'{value / base:.2f}x'


def _cell(value: Optional[float], base: Optional[float], fmt: str) -> str:
    if value is None:
        return 'n/a'
    return f'{value:{fmt}} ({_ratio(value, base)})'


def dump_results(results: Dict[Candidate, Result]) -> List[Dict[str, Any]]:
    """``results`` as a ``benchmark.json``'s ``results`` list, which :func:`load_results` reads."""
    return [dict(name=c.name, family=c.family, depth=c.depth, method=c.method,
                 compiled=c.compiled, blocks=r.blocks, params=r.params, flops=r.flops,
                 peak_memory_bytes=r.memory, forward_s=r.forward, train_step_s=r.train,
                 page_faults_per_train_step=r.faults)
            for c, r in results.items()]


def load_results(data: Dict[str, Any]) -> Dict[Candidate, Result]:
    """The results of a ``benchmark.json`` written by the tool (to re-render them)."""
    results = {}
    for e in data['results']:
        c = Candidate(e['family'], e['depth'], e['method'], e['compiled'])
        results[c] = Result(c, e['blocks'], e['params'], e['flops'], e['peak_memory_bytes'],
                            list(e['forward_s']), list(e['train_step_s']),
                            list(e.get('page_faults_per_train_step', [])))
    return results


def _backbone_label(c: Candidate) -> str:
    """A table row's backbone cell, e.g. ``ResNet-50`` or ``CIFAR-ResNet-20 +compile``."""
    family = 'ResNet' if c.family == 'imagenet' else 'CIFAR-ResNet'
    return f'{family}-{c.depth}{" +compile" if c.compiled else ""}'


def markdown_table(results: Dict[Candidate, Result]) -> str:
    """One row per candidate; every figure with its ratio to the plain ResNet of its depth.

    ``per block`` columns: (figure - plain figure) / number of blocks, in ms
    or MB: flat in depth for a method of linear cost. The last column: the
    median minor page faults of a training step (CPU; ``n/a`` elsewhere).
    """
    header = ('| backbone | method | blocks | params (M) | GFLOPs | forward (ms) | '
              'train step (ms) | peak train memory (MB) | forward per block (ms) | '
              'train step per block (ms) | memory per block (MB) | page faults per train step |')
    lines = [header, '|' + ' --- |' * 3 + ' ---: |' * 9]
    for c, r in results.items():
        b = results.get(c.baseline)

        def pair(attr: str, scale: float) -> Tuple[Optional[float], Optional[float]]:
            """``(value, baseline value)`` of a measurement, scaled; ``None`` if missing."""
            def get(res: Optional[Result]) -> Optional[float]:
                v = None if res is None else getattr(res, attr)
                return None if v is None or math.isnan(v) else v * scale
            return get(r), get(b)

        def per_block(attr: str, scale: float = 1e3) -> str:
            v, bv = pair(attr, scale)
            return 'n/a' if v is None or bv is None else f'{(v - bv) / r.blocks:+.3f}'

        cells = [_cell(*pair('params', 1e-6), '.3f'), _cell(*pair('flops', 1e-9), '.3f'),
                 _cell(*pair('forward_median', 1e3), '.1f'),
                 _cell(*pair('train_median', 1e3), '.1f'), _cell(*pair('memory', 2**-20), '.1f'),
                 per_block('forward_median'), per_block('train_median'),
                 per_block('memory', 2**-20),
                 'n/a' if math.isnan(r.faults_median) else f'{r.faults_median:.0f}']
        lines.append(f'| {_backbone_label(c)} | {c.method} | {r.blocks} | '
                     + ' | '.join(cells) + ' |')
    return '\n'.join(lines)


def round_ratios(result: Result, base: Result, attr: str) -> List[float]:
    """``result``'s time over ``base``'s, round by round (``attr``: ``forward`` or ``train``).

    :func:`run` times every candidate once per round, so the i-th figures of
    two candidates come from the same round, seconds apart. Empty where the
    two hold different numbers of rounds (nothing to pair) or a baseline
    time is not positive.
    """
    times, base_times = getattr(result, attr), getattr(base, attr)
    if len(times) != len(base_times) or not all(b > 0 for b in base_times):
        return []
    return [t / b for t, b in zip(times, base_times)]


def round_ratio_table(results: Dict[Candidate, Result]) -> str:
    """Each method's per-round ratios to the plain ResNet of its depth: min / median / max.

    A paired view of the run's noise next to :func:`markdown_table`'s ratio
    of medians: a machine whose speed drifts between rounds moves both
    candidates of a round alike, and the spread shows how far single rounds
    stray from the median. One row per candidate with a baseline in the
    results (the plain ResNets themselves are left out).
    """
    lines = ['| backbone | method | rounds | forward: ratio per round, min / median / max | '
             'train step: ratio per round, min / median / max |',
             '|' + ' --- |' * 2 + ' ---: |' * 3]
    for c, r in results.items():
        b = results.get(c.baseline)
        if c.method == 'none' or b is None:
            continue

        def spread(attr: str) -> str:
            ratios = round_ratios(r, b, attr)
            if not ratios:
                return 'n/a'
            return (f'{min(ratios):.3f}x / {statistics.median(ratios):.3f}x / '
                    f'{max(ratios):.3f}x')

        lines.append(f'| {_backbone_label(c)} | {c.method} | {len(r.train)} | '
                     f'{spread("forward")} | {spread("train")} |')
    return '\n'.join(lines)


#: Student's t, two-sided 95% (the 0.975 quantile), for 1 to 30 degrees of freedom
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t_interval(values: Sequence[float]) -> Tuple[float, float, float]:
    """``(mean, low, high)``: the mean and its two-sided 95% Student-t interval.

    ``low`` and ``high`` are NaN for fewer than two values. Past 30 degrees
    of freedom the quantile of 30 is used (a slightly wider interval).
    """
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan, math.nan
    half = _T975[min(len(values) - 1, 30) - 1] * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


def pooled_ratio_table(runs: Sequence[Dict[Candidate, Result]]) -> str:
    """Several runs' ratios to the plain ResNet, pooled: one row per candidate.

    One run on a shared machine settles a ratio to a few percent at best
    (its rounds share the machine's state of those minutes); several runs of
    the same code and setting settle it better. Per candidate with its
    plain ResNet in at least one run (by family, depth and method), for the
    forward and the training step: the runs' ratios of medians (the main
    table's figure), min - max; their mean with a 95% Student-t interval
    over the runs (each run one sample); and the median of every round's
    ratio of all the runs. Peak memory: the runs' ratios, min - max.
    """
    order = sorted({c for results in runs for c in results}, key=lambda c: (
        c.family != 'imagenet', c.depth, c.compiled,
        METHODS.index(c.method) if c.method in METHODS else len(METHODS), c.method))
    lines = ["| backbone | method | runs | rounds | forward: runs' ratios, min - max | forward: "
             "mean of the runs, 95% interval | forward: median of all rounds | train step: "
             "runs' ratios, min - max | train step: mean of the runs, 95% interval | train "
             "step: median of all rounds | peak train memory: runs' ratios, min - max |",
             '|' + ' --- |' * 2 + ' ---: |' * 9]
    for c in order:
        pairs = [(res[c], res[c.baseline]) for res in runs if c in res and c.baseline in res]
        if c.method == 'none' or not pairs:
            continue
        cells = [str(len(pairs)), str(sum(len(r.train) for r, _ in pairs))]
        for attr in ('forward', 'train'):
            ratios = [getattr(r, attr + '_median') / getattr(b, attr + '_median')
                      for r, b in pairs if getattr(r, attr) and getattr(b, attr)
                      and getattr(b, attr + '_median') > 0]
            rounds = [x for r, b in pairs for x in round_ratios(r, b, attr)]
            if not ratios:
                cells += ['n/a'] * 3
                continue
            mean, low, high = t_interval(ratios)
            cells += [f'{min(ratios):.3f}x - {max(ratios):.3f}x',
                      f'{mean:.3f}x' + ('' if math.isnan(low) else
                                        f' ({low:.3f}x - {high:.3f}x)'),
                      f'{statistics.median(rounds):.3f}x' if rounds else 'n/a']
        mem = [r.memory / b.memory for r, b in pairs if r.memory and b.memory]
        cells.append(f'{min(mem):.3f}x - {max(mem):.3f}x' if mem else 'n/a')
        lines.append(f'| {_backbone_label(c)} | {c.method} | ' + ' | '.join(cells) + ' |')
    return '\n'.join(lines)


def plot(results: Dict[Candidate, Result], path: str, title: str = '') -> None:
    """Extra cost over the plain ResNet against depth, one row per family, written as a PNG."""
    from matplotlib.figure import Figure

    metrics = [('params', 1e-6, 'parameters (M)'), ('flops', 1e-9, 'GFLOPs'),
               ('forward_median', 1e3, 'forward (ms)'),
               ('train_median', 1e3, 'train step (ms)'),
               ('memory', 2**-20, 'peak train memory (MB)')]
    families = [f for f in ('imagenet', 'cifar') if any(c.family == f for c in results)]
    fig = Figure(figsize=(3.2 * len(metrics), 2.9 * len(families) + 0.6), dpi=90,
                 layout='constrained')
    axes = fig.subplots(len(families), len(metrics), squeeze=False)
    colours = {'MRLALight': 'tab:green', 'FullLayerAttention': 'tab:blue', 'KCLA': 'tab:red'}
    for row, family in zip(axes, families):
        for ax, (attr, scale, label) in zip(row, metrics):
            for compiled in (False, True):
                for method in METHODS[1:]:
                    pts = []
                    for c, r in results.items():
                        b = results.get(c.baseline)
                        if (c.family, c.method, c.compiled) != (family, method, compiled) \
                                or b is None:
                            continue
                        v, bv = getattr(r, attr), getattr(b, attr)
                        if v is None or bv is None or math.isnan(v) or math.isnan(bv):
                            continue
                        pts.append((c.depth, (v - bv) * scale))
                    if pts:
                        pts.sort()
                        ax.plot([p[0] for p in pts], [p[1] for p in pts], 'o-' if not compiled
                                else 's--', ms=3, color=colours[method],
                                label=method + (' +compile' if compiled else ''))
            ax.axhline(0, color='0.7', lw=0.8)
            ax.set_xticks(sorted({c.depth for c in results if c.family == family}))
            ax.set_xlabel(f'depth ({"ResNet" if family == "imagenet" else "CIFAR ResNet"})',
                          fontsize=8)
            ax.set_title(f'extra {label}', fontsize=9)
            ax.tick_params(labelsize=7)
        row[0].legend(fontsize=7)
    fig.suptitle(title + '\nextra cost over the plain ResNet of the same depth '
                 '(linear in depth: constant cost per block)', fontsize=9)
    fig.savefig(path)
