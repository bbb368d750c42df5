"""``python -m radixcache.cli``: the command line, as ``radixcache`` runs it."""

from radixcache.cli import main

raise SystemExit(main())
