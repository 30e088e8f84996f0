"""What every HTML page layoutlab writes carries (the report, the plan figure's page): a Content-Security-Policy that
allows no script, no remote load and nothing but the page's own inline styles and data: images. The pages escape
what they show; the policy is the second wall, should an escaping bug ever let markup through."""

CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'; base-uri 'none'; form-action 'none'"
CSP_META = f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
