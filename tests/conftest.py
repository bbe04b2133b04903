import pytest

import distributed

#: Test modules whose every test is slow (whole multi-process runs: elastic restarts under torchrun, the
#: examples, the framework integrations' trainers). Slow tests elsewhere carry ``@pytest.mark.slow``.
SLOW_MODULES = frozenset({
    "test_elastic",
    "test_examples",
    "test_integrations_accelerate",
    "test_integrations_lightning",
    "test_integrations_transformers",
})

#: Single slow tests (``module::function``, every parametrization) in modules whose other tests are quick:
#: multi-rank resumes and long multi-process runs, each over ~5 s on 2 cores. ``test_test_tiers.py``
#: checks that every entry still names a test.
SLOW_TESTS = frozenset({
    "test_adaptive::test_ranks_with_different_gradients_take_identical_decisions_and_bytes_follow_the_ranks",
    "test_adaptive::test_resume_just_before_a_switch_equals_not_stopping",
    "test_averaging::test_hierarchical_averager_on_four_ranks_averages_the_right_groups_at_the_right_steps",
    "test_cli_check::test_one_process_report_with_a_user_batch",
    "test_cli_inspect::test_command_line_smoke",
    "test_comm_collectives::test_collectives_give_the_same_results_as_their_definitions",
    "test_diagnostics::test_the_demo_training_records_the_error_along_its_curve",
    "test_fuzz::test_full_rank_world_reproduces_the_exact_mean",
    "test_gpt_task::test_demo_trains_gpt_on_two_workers",
    "test_hooks_dist::test_load_state_dict_before_or_after_register_comm_hook_resumes_the_same",
    "test_hooks_dist::test_resume_from_checkpoint_equals_uninterrupted_run",
    "test_state_options::test_the_documented_constructor_call_constructs_and_trains",
    "test_zero_overlap::test_powersgd_rank_1_converges_and_ranks_agree",
})


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = getattr(item.module, "__name__", None)
        function = getattr(item, "originalname", None) or item.name
        if module in SLOW_MODULES or f"{module}::{function}" in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session", autouse=True)
def _close_worker_groups():
    yield
    distributed.close_all()
