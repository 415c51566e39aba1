"""harness: linearize pretrained language models with linear-time mixers and distillation.

    import harness
    teacher = harness.load_teacher("smollm2-135m-instruct-gguf")
    student = harness.build_student(teacher, "gated_deltanet")
    harness.MIXERS  # the mixers by name: the built-in ones, then plug-ins
    harness.register_mixer("mine", MyMixer)  # a plug-in in this process (docs/MIXERS.md: entry points for all)

Importing harness registers the student classes with transformers' Auto* factories, so a saved student
loads with `AutoModelForCausalLM.from_pretrained(dir)`.
"""

from harness.mixers import MIXERS, register_mixer
from harness.student import HarnessConfig, HarnessForCausalLM, RecurrentCache, build_student

__version__ = "0.1.0"


def load_teacher(*args, **kwargs):
    """Load a teacher; see `harness.teacher.load_teacher`."""
    from harness.teacher import load_teacher as _load

    return _load(*args, **kwargs)


__all__ = ["MIXERS", "HarnessConfig", "HarnessForCausalLM", "RecurrentCache", "build_student", "load_teacher",
           "register_mixer"]
