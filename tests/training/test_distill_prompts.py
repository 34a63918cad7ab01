"""The scaled distillation prompts (training/distill_prompts.py): thousands of requests of every kind from sources
shipped with Python or made here, deduplicated, never a bench prompt, the same for a seed."""

from __future__ import annotations

from specdeploy.spec.prompt_sets import load_prompts
from specdeploy.training import distill_prompts as source


def test_the_sources_give_thousands_of_distinct_prompts_and_no_bench_prompt():
    bench = [p["prompt"] for p in load_prompts()]
    own = ["How do I keep basil alive on a windowsill?", "Write a haiku about trains."]
    prompts = source.distillation_prompts(own, seed=0, exclude=bench + own[1:])
    assert len(prompts) > 5000 and len(set(prompts)) == len(prompts)
    assert not set(bench) & set(prompts) and own[0] in prompts and own[1] not in prompts
    assert prompts == source.distillation_prompts(own, seed=0, exclude=bench + own[1:])
    assert prompts != source.distillation_prompts(own, seed=1, exclude=bench + own[1:])
    kinds = {"Complete this Python function", "language reference", "Write a short Python example that uses"}
    assert all(any(kind in p for p in prompts[:200]) for kind in kinds)  # a prefix mixes the sources


def test_the_standard_librarys_documentation_becomes_one_task_an_object():
    documented = source.documented_objects()
    names = [name for name, _, _, _ in documented]
    assert len(documented) > 2000 and len(set(names)) == len(names)
    assert "json.dumps" in names and "builtins.str.split" in names
    assert not any(name.split(".")[0] in source.SKIPPED_MODULES for name in names)


def test_the_targets_own_requests_are_cleaned_or_dropped():
    assert source.clean_request('Request: "How can I roast vegetables evenly?"\n\nSure!') == \
        "How can I roast vegetables evenly?"
    assert source.clean_request("Sure, here is a question about bread.") is None
    assert source.clean_request("Why?") is None
    requests = source.self_instruct_requests()
    assert len(requests) == len(source.seed_topics()) * len(source.SEED_KINDS) == len(set(requests))
    assert requests != source.self_instruct_requests(seed=1)


def test_the_held_out_split_is_seeded_and_disjoint():
    prompts = [f"prompt {i}" for i in range(50)]
    train, held = source.split_held_out(prompts, 5)
    assert len(held) == 5 and not set(train) & set(held) and set(train) | set(held) == set(prompts)
    assert (train, held) == source.split_held_out(prompts, 5)
