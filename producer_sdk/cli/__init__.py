"""The producer commands (``tokenrelay submit|batch|stats|cancel|status|result``): the parser
and the commands (``main``), their exit codes (``exit_codes``) and the queue report of
``tokenrelay stats`` (``stats``)."""
