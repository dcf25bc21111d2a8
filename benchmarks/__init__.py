"""The benches: each module measures one thing and writes its result with an envelope (`monim bench --list`)."""
