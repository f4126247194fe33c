"""Launchers and PyTorch registration: allocate, build the grid, launch. No math here."""
