"""Code that runs inside worker processes: the entry point, the warm child, exit guards, CPU binding."""
