"""Command-line tools, each ``python -m shardlab.tools.<name>`` (the Makefile's targets call them):

- ``smoke``: the stack works, as JSON (notebook 00 runs it);
- ``bench``: start-up and step costs measured side by side;
- ``handout``: the learners' copy of the notebooks, answers blanked (``make handout``);
- ``agenda``: a workshop's agenda from INSTRUCTORS.md's timings;
- ``instructor_notes``: the parts of ``instructors/``'s notes that come from the notebooks;
- ``gpucheck``: what only GPUs prove, in one command (``make gpu-check``);
- ``morning``: the machine check for the morning of a workshop (``make morning``).
"""

from .. import load_on_first_use

__getattr__, __dir__ = load_on_first_use(__name__)
