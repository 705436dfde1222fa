"""The run: the controller process, the run directory (metrics, checkpoints), progress and plots."""
