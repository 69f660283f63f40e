"""Makes lm-eval's own ``lm_eval`` command know ``--model gptj_flax`` (imported at interpreter start).

lm-eval 0.4 finds models only in its in-process registry, with no entry-point discovery. Installing
gptj_flax puts ``gptj_flax_lm_eval.pth`` in site-packages (see setup.py); its one line imports this
module when Python starts. All it does then is put a finder on ``sys.meta_path``: when
``lm_eval.api.registry`` is imported, the finder lets that module run and then registers
``gptj_flax`` in it as a lazy ``module:Class`` path — JAX and the adapter are imported only if
lm-eval builds the model. A process that never imports lm-eval pays for this module alone.

It lives outside the ``gptj_flax`` package on purpose: importing the package this early (before
Python puts the script's directory or the working directory on ``sys.path``) would tie every
process to the installed copy even where a source checkout comes first on the path. Any error is
swallowed: a broken hook must never break an unrelated interpreter.
"""

import sys

_REGISTRY = "lm_eval.api.registry"
_NAME, _TARGET = "gptj_flax", "gptj_flax.evaluation.harness:GPTJFlaxLM"


def _register(registry) -> None:
    # lm-eval imports its own models' table only while its registry is empty: fill it first, or
    # `--model hf` would stop working (gptj_flax/evaluation/harness.py does the same).
    import lm_eval.models  # noqa: F401

    # Importing harness.py first registers the class itself; its decorator also accepts replacing
    # this placeholder with the class (same "module:name"), so the two paths never collide.
    if _NAME not in registry.model_registry:
        registry.model_registry.register(_NAME, target=_TARGET)


class _RegistryWatcher:
    """A meta-path finder that answers for no module: it wraps the loader of the registry's."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _REGISTRY:
            return None
        try:
            sys.meta_path.remove(self)  # one registry per process: watch no more
            for finder in list(sys.meta_path):  # the spec that Python would have found without us
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
            if hasattr(spec.loader, "exec_module"):
                run_module = spec.loader.exec_module

                def exec_module(module):
                    run_module(module)  # the registry module's errors are lm-eval's: let them through
                    try:
                        _register(module)
                    except Exception:
                        pass

                spec.loader.exec_module = exec_module  # this spec's loader only
            return spec
        except Exception:
            return None  # Python's own finders take over (the registry, without gptj_flax)


try:
    if _REGISTRY in sys.modules:  # imported late (not from the .pth): register right away
        _register(sys.modules[_REGISTRY])
    elif not any(type(finder).__name__ == "_RegistryWatcher" for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegistryWatcher())
except Exception:
    pass
