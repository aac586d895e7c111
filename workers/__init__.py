"""Faust agents of the write path, one per stage, each thin over the stage functions in ``stam.stages``."""
