"""Where a live decode step goes: profiler traces sorted into components, and the step predicted from kernel results."""
