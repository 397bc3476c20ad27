"""Run management below the commands: the memory planner (plan), Slurm rendering (submit), local sweeps (sweep)
and run comparison (compare). The commands in `megatron_pdm.commands` import these; none of these imports a command."""
