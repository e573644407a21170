"""Compiled kernels: the C++ CPU library (``cpu_library``), its sources listed once."""
