"""``python -m pykv ...`` runs the pykv command."""
import sys

from .cli.main import main

sys.exit(main())
