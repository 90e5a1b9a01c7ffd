"""The verl tests' shared fixtures. Of the end-to-end tests through verl's own Ray worker
(tests/integrations/verl_ray.py has the rest of what they share): ``ray_cluster``, a local Ray whose workers
import from this folder and tests/support, and ``model``, the tiny Qwen2 saved for the workers;
module-scoped, so each test module gets its own (test_parity.py starts its own cluster). Of the
tests that patch the model class: ``qwen2_forward``."""
import os

import pytest

from verl_cpu import worker_env
from verl_helpers import VOCAB, tiny_qwen2
from verl_ray import HERE, REPO, SUPPORT


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    import ray

    tmp = tmp_path_factory.mktemp("ray")
    pythonpath = os.pathsep.join([REPO, HERE, SUPPORT, os.environ.get("PYTHONPATH", "")])
    # 3 logical CPUs: the three worker processes (one CPU each) run side by side
    ray.init(num_cpus=3, include_dashboard=False, _temp_dir=str(tmp), log_to_driver=False,
             runtime_env={"env_vars": {**worker_env(), "PYTHONPATH": pythonpath, "TRITON_INTERPRET": "1"}})
    yield ray
    ray.shutdown()


def _save_tokenizer(path):
    """A word-level tokenizer over the model's vocabulary (verl 0.7.x's legacy worker loads one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1", pad_token="t2").save_pretrained(path)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The tiny Qwen2 (in the driver) and its saved copy, with a tokenizer, for the workers."""
    model = tiny_qwen2()
    path = tmp_path_factory.mktemp("model")
    model.save_pretrained(path)
    _save_tokenizer(path)
    return model, path


@pytest.fixture
def qwen2_forward():
    """apply_monkey_patch replaces Qwen2ForCausalLM.forward on the class: restore it after."""
    from transformers import Qwen2ForCausalLM

    original = Qwen2ForCausalLM.forward
    yield original
    Qwen2ForCausalLM.forward = original
