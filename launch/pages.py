"""What every HTML page layoutlab writes carries (the report, the plan figure's page): a Content-Security-Policy that
allows no remote load and nothing but the page's own inline styles and data: images, and no script but one the page
names by its hash (the plan page's selectors; the report has none). The pages escape what they show; the policy is
the second wall, should an escaping bug ever let markup through."""
import base64
import hashlib

CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'; base-uri 'none'; form-action 'none'"
CSP_META = f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'


def csp_meta_running(script: str) -> str:
    """CSP_META that lets the one inline script whose text is exactly `script` run, named by its SHA-256: a script
    injected beside it hashes otherwise and stays dead, as do inline event handlers."""
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    return f"<meta http-equiv=\"Content-Security-Policy\" content=\"{CSP}; script-src 'sha256-{digest}'\">"
