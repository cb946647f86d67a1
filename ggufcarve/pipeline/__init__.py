"""One plan, one command: a TOML plan (plan.py) turned once into its list of stages (stages.py),
which the dry run, the run and the resume walk (run.py); a stage is skipped when its recorded
inputs and parameters did not change (state.py).

    from ggufcarve.pipeline.plan import load_plan
    from ggufcarve.pipeline.run import execute_run, preview_run
    plan = load_plan("plans/reap-128.toml")
    preview_run(plan)        # the stages, their outputs, sizes and the disk they need
    execute_run(plan)        # select -> prune -> imatrix -> ladder -> evaluate -> card -> verify
"""
