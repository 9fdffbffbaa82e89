//! Redirects, for every HTTP client here: none is followed. A redirected POST becomes a
//! bodiless GET (301/302/303), a redirect to another origin drops the credential, and the page
//! a redirect lands on answers for a request nobody meant: a 3xx is reported, with where it
//! pointed, as the failure it is.

/// The redirect policy of every client: follow none; the 3xx itself is the answer.
pub fn never() -> reqwest::redirect::Policy {
    reqwest::redirect::Policy::none()
}

/// Why a redirect is a failure: `<who> answered <status>, a redirect to <Location> (not
/// followed)`. The Location is the remote's to choose: shown without its query or fragment (a
/// sign-on redirect carries state there), lossily, at most 512 characters.
pub fn reason(who: &str, response: &reqwest::Response) -> String {
    let status = response.status();
    match response.headers().get(reqwest::header::LOCATION) {
        Some(location) => {
            let location = String::from_utf8_lossy(location.as_bytes());
            let to: String = location
                .split(['?', '#'])
                .next()
                .unwrap_or_default()
                .chars()
                .take(512)
                .collect();
            format!("{who} answered {status}, a redirect to {to} (not followed)")
        }
        None => format!("{who} answered {status}, a redirect without a Location (not followed)"),
    }
}
