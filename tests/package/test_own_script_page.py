"""docs/own-script.md shows what docs/tuning.md measured and what examples/own_script.py does: the page a
new user copies from must not show a configuration the measurements advise against, nor leave out what a
bitwise resume needs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs" / "own-script.md").read_text()
TUNING = (ROOT / "docs" / "tuning.md").read_text()
EXAMPLE = (ROOT / "examples" / "own_script.py").read_text()


def _state_arguments(code: str) -> dict[str, str]:
    """The keyword arguments of the first ``PowerSGDState(...)`` call in ``code``, as written."""
    code = re.sub(r"#[^\n]*", "", code)
    start = code.index("PowerSGDState(") + len("PowerSGDState(")
    depth, end = 1, start
    while depth:
        depth += {"(": 1, ")": -1}.get(code[end], 0)
        end += 1
    return {key: value.strip() for key, value in re.findall(r"(\w+)=([^,]+)", code[start:end - 1])}


def test_the_first_snippet_is_what_check_gives_gpt2_with_adamw_and_links_it():
    import sys

    import gradpress.tools.zoo
    from gradpress.tools.check.advice import model_width, recommended_powersgd
    from gradpress.tools.check.report import powersgd_choice
    from gradpress.tools.quality_map import QUALITY_TARGET, advise

    recipe = _state_arguments(TUNING[TUNING.index("## What to use, as measured so far"):])
    shown = _state_arguments(re.findall(r"```python\n(.*?)```", PAGE, flags=re.S)[0])
    prose = " ".join(PAGE.split())
    # nanoGPT trains GPT-2 with AdamW: the snippet is the state gradpress check builds for it (the quality
    # map's rank and options at nanoGPT's tokens per optimizer step), and the page gives the map's label.
    gpt2 = [p.shape for p in gradpress.tools.zoo.build_model("gpt2").parameters()]
    tokens = 12 * 1024 * 40  # batch_size x block_size x gradient_accumulation_steps (over all ranks)
    assert f"--optimizer adamw --tokens-per-step {tokens}" in PAGE and f"{tokens:,}" in prose
    advice = advise(model_width(gpt2), "adamw", tokens)
    expected = {"matrix_approximation_rank": advice.rank, **advice.powersgd_options}
    assert {key: int(shown[key]) for key in expected} == expected and "warm_up_bytes_per_weight" in expected
    assert advice.status == "beyond the map (rule)" and f"`{advice.status_text}`" in prose
    assert f"AutoRank(max_rank={2 * advice.rank})" in prose  # room above the rule, as tuning.md says
    choice = powersgd_choice(gpt2, advice)
    assert (f"rank {advice.rank}: {choice['powersgd_bytes_per_step'] / 1e6:.3g} MB against "
            f"{choice['allreduce_bytes_per_step'] / 1e6:.3g} MB, {choice['powersgd_bytes_ratio']:.1f}x fewer") in prose
    assert recommended_powersgd(gpt2) == (22, 2)  # the rule's rank, which the page no longer calls the advice
    assert shown["bytes_per_weight"] == recipe["bytes_per_weight"]
    # Compression from a tenth of the run, whatever the loop calls its length.
    assert recipe["start_powerSGD_iter"].endswith("// 10") and shown["start_powerSGD_iter"].endswith("// 10")
    assert "](tuning.md#what-to-use-as-measured-so-far)" in PAGE
    assert "rank 16 on a width-128 transformer" in prose and "learning rate tuned for allreduce" in prose
    # Beside the target, the run-to-run spread the study measured (BENCHMARKS.md: about 1.4 points).
    assert f"target is {QUALITY_TARGET}%" in prose and "about 1.4 points either way" in prose
    assert "the recommended configuration" not in prose
    # The flags the page gives for running the example: the rule's for its model, and check's with AdamW at
    # the example's default tokens per step (8 sequences of 32, 2 accumulation steps, 2 ranks in its test).
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import own_script
    finally:
        sys.path.remove(str(ROOT / "examples"))
    model = own_script.GPT(own_script.text_codes()[2], block_size=32)
    shapes = [p.shape for p in model.parameters()]
    rank, wire = recommended_powersgd(shapes)
    assert f"`--rank {rank} --bytes-per-weight {wire}`" in prose
    example = advise(model_width(shapes), "adamw", 8 * 32 * 2 * 2)
    assert example.status == "beyond the map (rule)" and f"gives the width rule's rank {example.rank}" in prose
    assert f"`--rank {example.rank} --bytes-per-weight {example.powersgd_options['bytes_per_weight']}`" in prose


def test_the_page_says_in_prose_that_batches_must_depend_on_the_iteration():
    section = PAGE[PAGE.index("## A resume that repeats the uninterrupted run"):]
    prose = " ".join(section.split())
    assert "depend on the iteration alone" in prose and "seeds its generator once" in prose
    # The pattern it shows is the one the example runs (and test_examples checks bitwise).
    seed = "manual_seed(1000 * iter_num + rank)"
    pattern = [line.strip() for line in section.splitlines() if line.startswith("    ") and line.strip()]
    assert any(seed in line for line in pattern) and any("generator=gen" in line for line in pattern)
    assert seed in EXAMPLE


def test_the_page_names_the_gather_state_fix_and_a_collective_timeout():
    prose = " ".join(PAGE.split())
    assert "every rank must call it at the same iteration" in prose and "arrival_timeout" in prose
    assert "timeout=timedelta(minutes=10)" in prose and "timeout=timedelta(minutes=10)" in EXAMPLE
    assert 'on_world_size_change="fresh"' in prose
