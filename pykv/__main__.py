"""``python -m pykv ...`` runs the pykv command."""
import sys

from .cli import main

sys.exit(main())
