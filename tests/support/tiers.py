"""Which test files are unit tests: the one list, read by tests/conftest.py (it marks their tests
`unit`) and checked by tests/test_tiers.py.

A unit test checks one module's logic on values it writes itself: config checks, option parsing,
plans and meshes, schedules, data formats, the package's own structure. It builds no program of
the library (no step, engine, job, pipeline executor or subprocess: `PROGRAM_BUILDERS` below, which
tests/test_tiers.py looks for in each listed file) and runs in seconds:

    python -m pytest -m unit                  # the unit tests, about a minute on 2 cores
    python -m pytest -m "not unit"            # the integration runs: steps compiled on 8 devices
                                              # against single-device references, jobs, notebooks

Every other test file is an integration run. A unit file that starts building programs moves
out of this list (tests/test_tiers.py names the call).
"""

MARKER = "unit"

# Calls that build or run a program of the library: none of them may appear in a unit file. (A
# job's `cli.main` is not among them: a unit test may print `--help`.)
PROGRAM_BUILDERS = frozenset({
    "make_step", "ZeroStep", "HybridEngine", "shard_map", "jit", "load_pretrained", "run_ppo",
    "run", "Popen", "check_output", "init_from", "compile", "lower",
})

UNIT_FILES = (
    "tests/test_ci_legs.py",
    "tests/test_tiers.py",
    "tests/zeroxla/app/run/test_app_layout.py",
    "tests/zeroxla/app/run/test_option_tables.py",
    "tests/zeroxla/app/test_cli_args.py",
    "tests/zeroxla/app/test_interrupt.py",
    "tests/zeroxla/app/test_train_defaults.py",
    "tests/zeroxla/checkpoint/test_retention.py",
    "tests/zeroxla/deepspeed/test_zero_config.py",
    "tests/zeroxla/inference/test_sampling_knobs.py",
    "tests/zeroxla/pipeline/test_deepspeed_json.py",
    "tests/zeroxla/pipeline/test_partition.py",
    "tests/zeroxla/pipeline/test_zero_bubble.py",
    "tests/zeroxla/sharding/test_config.py",
    "tests/zeroxla/sharding/test_mesh.py",
    "tests/zeroxla/sharding/test_plan.py",
)
