"""``kvoffload bench multi-gpu``: one process per GPU storing and loading at once."""
