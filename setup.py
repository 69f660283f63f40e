"""Build steps only — the project's metadata is in pyproject.toml.

Every wheel, regular or editable (PEP 660), also carries ``gptj_flax_lm_eval.pth`` at its root, so
installing it puts the file in site-packages. Python runs the file's import line at every start;
``_gptj_flax_lm_eval_hook`` then registers the ``gptj_flax`` model with lm-eval when lm-eval is
imported, which makes lm-eval's own ``lm_eval --model gptj_flax …`` work.
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

# Site runs .pth files in name order: this one after setuptools' "__editable__.gptj_flax-….pth",
# whose import finder is what makes the hook module importable in an editable install. The line
# imports the hook only if it is there: an editable install whose checkout has moved or lost the
# file says nothing at every interpreter start, rather than a traceback.
PTH_NAME = "gptj_flax_lm_eval.pth"
PTH_LINE = (
    b"import importlib.util; importlib.util.find_spec('_gptj_flax_lm_eval_hook') "
    b"and __import__('_gptj_flax_lm_eval_hook')\n"
)


class BuildPy(build_py):
    """Regular wheels: the .pth joins the modules in ``build_lib``, the wheel's root."""

    def run(self):
        super().run()
        if not self.editable_mode:  # the editable wheel gets it from EditableWheel
            with open(os.path.join(self.build_lib, PTH_NAME), "wb") as f:
                f.write(PTH_LINE)


class EditableWheel(editable_wheel):
    """Editable wheels hold no modules, only setuptools' own .pth and finder: the .pth goes in beside them."""

    def _select_strategy(self, name, tag, build_lib):  # setuptools' (private) writer of the wheel's files
        strategy, command = super()._select_strategy(name, tag, build_lib), self

        class WithPth:
            def __enter__(self):
                strategy.__enter__()
                return self

            def __exit__(self, *exc_info):
                return strategy.__exit__(*exc_info)

            def __call__(self, wheel, files, mapping):
                strategy(wheel, files, mapping)
                wheel.writestr(PTH_NAME, PTH_LINE)
                command.pth_written = True

        return WithPth()

    def run(self):
        self.pth_written = False
        super().run()
        if not self.pth_written:  # a setuptools that no longer calls _select_strategy: fail, not a silent miss
            raise RuntimeError(
                f"setup.py could not add {PTH_NAME} to the editable wheel: "
                "see EditableWheel for the setuptools internals it relies on"
            )


setup(cmdclass={"build_py": BuildPy, "editable_wheel": EditableWheel})
