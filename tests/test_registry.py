"""Adding a drafter is one class and one registration: it becomes a method everywhere methods are listed."""
from __future__ import annotations

import pytest

from lyanna.cli import main as cli_main
from lyanna.decoding import Decoder, GenerationRequest
from lyanna.drafters.base import Drafter
from lyanna.drafters.registry import arch_providing, method_names, register, trainable_archs, unregister
from lyanna.drafters.tree import DraftTree
from lyanna.errors import LyannaError
from lyanna.train import main as train_main


class RepeatDrafter(Drafter):
    """A toy model-free drafter: proposes the last token twice more (right on repetitive text)."""

    VARIANTS = {"repeat": {"times": 2}, "repeat-once": {"times": 1}}

    def __init__(self, times: int):
        self.times = times

    def start(self, prompt_ids, hidden):
        pass

    def propose(self, context, max_depth):
        return DraftTree.chain([int(context[-1])] * min(self.times, max_depth))

    def commit(self, tokens, hidden):
        pass


class ToyHead(Drafter):
    """A toy draft head: loads checkpoints of its own arch, trained with the EAGLE recipe."""

    ARCH = "toyhead"
    VARIANTS = {"toyhead": {}}
    TRAINING = "lyanna.training.recipes:EagleRecipe"

    def start(self, prompt_ids, hidden): ...
    def propose(self, context, max_depth): ...
    def commit(self, tokens, hidden): ...


@pytest.fixture
def registered():
    for cls in (RepeatDrafter, ToyHead):
        register(cls)
    yield
    for cls in (RepeatDrafter, ToyHead):
        unregister(cls)


def _help(main, argv, capsys) -> str:
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    return " ".join(capsys.readouterr().out.split())


def test_a_registered_drafter_is_a_method_of_every_decoder_and_listed_by_bench(registered, tiny_decoder, capsys):
    d = Decoder(tiny_decoder.target, default_drafts=False)
    assert {"repeat", "repeat-once"} <= set(d.methods) and "repeat" in method_names()
    assert "repeat-once" in _help(cli_main, ["bench"], capsys)
    ids = d.encode("aaaa")
    req = GenerationRequest(max_new_tokens=16)
    ar, toy = d.generate(ids, req, method="ar"), d.generate(ids, req, method="repeat", budget=4)
    assert toy.tokens == ar.tokens and toy.draft_tokens > 0  # it drafted, and the loop kept it lossless


def test_a_registered_head_is_a_train_arch_and_needs_its_checkpoint(registered, tiny_decoder, capsys):
    assert "toyhead" in trainable_archs() and arch_providing("toyhead") == "toyhead"
    assert "{eagle,lyanna,toyhead}" in _help(train_main, ["fit"], capsys)
    assert "toyhead" in _help(cli_main, ["bench"], capsys)
    d = Decoder(tiny_decoder.target, default_drafts=False)
    assert "toyhead" not in d.methods  # a head's methods come with a checkpoint
    with pytest.raises(LyannaError, match="needs a draft head.*'toyhead'"):
        d.drafter_for("toyhead")


def test_unregistering_removes_it_everywhere(tiny_decoder, capsys):
    register(RepeatDrafter)
    unregister(RepeatDrafter)
    assert "repeat" not in Decoder(tiny_decoder.target, default_drafts=False).methods
    assert "repeat-once" not in _help(cli_main, ["bench"], capsys)  # (bench has a --repeats option)


def test_registration_refuses_what_would_be_ambiguous():
    class NotADrafter:
        VARIANTS = {"x": {}}

    class NoMethods(RepeatDrafter):
        VARIANTS = {}

    class TakesSuffix(RepeatDrafter):
        VARIANTS = {"suffix": {"times": 1}}

    class SecondEagle(ToyHead):
        ARCH = "eagle"
        VARIANTS = {"eagle2": {}}

    for cls, message in ((NotADrafter, "not a Drafter"), (NoMethods, "no method"), (TakesSuffix, "suffix.*taken"),
                         (SecondEagle, "arch 'eagle' already")):
        with pytest.raises(TypeError, match=message):
            register(cls)
    assert "eagle2" not in method_names()
