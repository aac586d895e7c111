"""Topics as code and the Faust application of the write path."""
