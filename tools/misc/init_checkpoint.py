"""Save a config's model as initialised for training, before any step.

The weights are drawn as mmengine's ``Runner`` draws them: the config's
``randomness.seed`` is set, the model is built and ``init_weights()`` runs
(``init_cfg`` included, so a ``Pretrained`` backbone is loaded). The file is
an ordinary mmengine checkpoint (``meta``, ``state_dict``) that
``tools/test.py`` evaluates: the "iteration 0" baseline of a training run.

Example::

    python tools/misc/init_checkpoint.py CONFIG work_dirs/init.pth --cfg-options ...
"""
import argparse
from typing import Optional, Sequence

from mmengine.config import Config, DictAction
from mmengine.registry import MODELS, init_default_scope
from mmengine.runner import save_checkpoint, set_random_seed

import kcla_mm  # noqa: F401  (registers the components)
import kcla_mm.host_fixes  # noqa: F401  (safe loading, atomic saving, CPU distributed)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('config', help='config file path')
    parser.add_argument('out', help='checkpoint file to write')
    parser.add_argument('--cfg-options', nargs='+', action=DictAction,
                        help='override settings of the config (key=value)')
    return parser.parse_args(argv)


def initial_state_dict(cfg: Config) -> dict:
    """The state dict of ``cfg.model`` after seeding and ``init_weights()``."""
    init_default_scope(cfg.get('default_scope', 'mmengine'))
    set_random_seed(cfg.get('randomness', {}).get('seed', 0))
    model = MODELS.build(cfg.model)
    model.init_weights()
    return model.state_dict()


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    cfg = Config.fromfile(args.config)
    if args.cfg_options is not None:
        cfg.merge_from_dict(args.cfg_options)
    state_dict = initial_state_dict(cfg)
    # mmengine's writer: atomic through kcla_mm.host_fixes, and creates the folder
    save_checkpoint(dict(meta=dict(iter=0, epoch=0, note='initialised, not trained'),
                         state_dict=state_dict), args.out)
    print(f'saved the initialised model of {args.config} to {args.out}')


if __name__ == '__main__':
    main()
