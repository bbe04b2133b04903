"""gradpress.powersgd.pipeline.OrderedPipeline: the order in which collectives are issued."""

from __future__ import annotations


def test_pipeline_without_advance_on_submit_issues_all_first_phases_then_the_rest() -> None:
    from gradpress.powersgd.pipeline import OrderedPipeline

    issued: list[str] = []

    class Done:
        def wait(self) -> None:
            return None

    def task(name: str):
        issued.append(f"{name}.P")
        yield Done()
        issued.append(f"{name}.Q")
        yield Done()

    for advance, expected in ((True, ["a.P", "a.Q", "b.P", "b.Q", "c.P"]), (False, ["a.P", "b.P", "c.P"])):
        issued.clear()
        pipeline = OrderedPipeline(advance_on_submit=advance)
        for name in "abc":
            pipeline.submit(task(name), lambda: None, lambda exc: None)
        assert issued == expected  # what happened during the backward pass
        pipeline.drain()
        assert sorted(issued) == ["a.P", "a.Q", "b.P", "b.Q", "c.P", "c.Q"]
