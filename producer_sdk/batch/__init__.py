"""The bulk batch runner (OpenAI Batch file format, resumable and memory-bounded): the run
(``runner``), its output lines (``lines``), one run per output file (``lock``), the wait for a
served queue (``watch``), where a batch stands (``status``) and its commands (``cli``)."""
