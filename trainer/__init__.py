"""The trainer core: one data-parallel rank's model, optimizer and step, runnable without Monarch."""
