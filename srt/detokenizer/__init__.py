"""The detokenizer process: incremental detokenization and stop strings, between the scheduler and the HTTP process."""
